"""One training process from start to summary: distributed set-up, the run directory's lock,
"already finished", the loop under the hang watchdog (engine.train.fit), errors worded as one
line, and the records a process leaves: state.json, a failure's line and summary.json.

`python -m engine.train RECIPE [key=value ...]` runs train() here through engine.cli."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from engine import checkpoint as ckpt
from engine import config as C
from engine import distributed as D
from engine import hang, preempt, rundir
from engine.assemble import setup
from engine.checkpoint import best
from engine.checkpoint import state as checkpoint_state
from engine.config.identity import check_same_request
from engine.data import fingerprint
from engine.evaluate import metric_names
from engine.faults import RunError
from engine.recipe import Recipe
from engine.redact import redact
from engine.results import summary_name, task_facts
from engine.run import Run
from engine.seeding import set_deterministic
from engine.tasks import check_supported, task_of
from engine.tracking import log, log_to, to_log_file
from engine.train import fit

PEER_FAILURES = ("Timed out", "timed out", "Connection closed by peer", "Connection reset")


class PeerFailure(RunError):
    """Reported by every rank that saw it (each says its own view)."""


def train(cfg: C.Config, recipe: Recipe) -> int:
    """One training process: distributed set-up, the run, its summary, and tear-down."""
    started = time.perf_counter()
    denv = D.read_env()
    D.limit_threads(denv)
    set_deterministic(cfg.deterministic)
    device = D.pick_device(cfg.device, denv)
    D.init(denv, cfg.dist, device)
    run, lock = None, None
    try:
        name = D.broadcast_object(rundir.decide_run_name(cfg.run.name, cfg.recipe, cfg.variant))
        C.finalize(cfg, {"run.name": name})
        check_supported(task_of(recipe), cfg.train, cfg.mix)
        lock, done = lock_run_dir(cfg, denv, recipe.resume_safe)
        if done is not None:
            return 0
        run = setup(cfg, recipe, denv, device)
        begin(run, started)
        reason = fit_watched(run, holds_dir=lock is not None)
        return conclude(run, reason, run.progress.total_seconds())
    except BaseException as err:
        if lock is not None:  # rank 0, holding the run directory
            record_failure(run, rundir.decide_run_dir(cfg.run.root, cfg.recipe, cfg.run.name), err)
        raise
    finally:
        log_to(None)
        if run is not None:
            run.close()  # the lock with it
        elif lock is not None:
            rundir.release(lock)  # a run directory made for a refused launch goes too
        run = None  # the wrapped model holds the process group: dropped before it is destroyed
        D.shutdown()


def begin(run: Run, started: float) -> None:
    """The run set up: its time counts this whole start (from the process's), and state.json
    says it is running."""
    run.progress.started = started
    record_state(run, "running")


def lock_run_dir(
    cfg: C.Config, denv: D.DistEnv, also_safe: tuple[str, ...] = ()
) -> tuple[int | None, int | None]:
    """(rank 0's lock on the run directory, the step the run there finished at or None).
    Taken before anything is said about the run (resuming it, or that it is done), so a
    second launch on a live run is refused first; set-up claims the same lock again."""
    run_dir = rundir.decide_run_dir(cfg.run.root, cfg.recipe, cfg.run.name)
    lock = D.on_main(lambda: rundir.acquire(run_dir))
    if lock is not None:
        log_to(run_dir / rundir.LOG_NAME)  # rank 0's lines, from here on, in its train.log
    refused, done = D.broadcast_object(standing(cfg, run_dir, also_safe) if denv.is_main else None)
    if refused:  # every rank: one name, one request (a queued job, too, fails here)
        if lock is not None:  # the run stays as it was, the refusal noted beside it
            record_failure(None, run_dir, C.ConfigError(refused))
            rundir.release(lock)
        raise C.ConfigError(refused)
    if done is not None and denv.is_main:
        log(
            f"run {run_dir} already finished at step {done}; nothing to do (start another "
            "with a new run.name)"
        )
    return lock, done


def standing(cfg: C.Config, run_dir: Path, also_safe: tuple[str, ...]) -> tuple[str, int | None]:
    """Rank 0, holding the lock: (why this request may not continue the run in run_dir, ""
    when it may; the step that run finished at, None when there is training to do). A run
    finished from another request is refused, never "nothing to do"."""
    try:
        check_one_request(cfg, run_dir, also_safe)
    except C.ConfigError as err:
        return str(err), None
    return "", finished_at(cfg, run_dir)


def check_one_request(cfg: C.Config, run_dir: Path, also_safe: tuple[str, ...]) -> None:
    """One run name, one request (engine.config.identity): a request that is not the one the
    run in run_dir trained from is refused; run.overwrite moves that run aside instead. The
    check before the queue (engine.cli) and a start holding the run's lock both ask it."""
    if cfg.run.overwrite:
        return
    trained = rundir.holds_a_run(run_dir)
    current = redact(cfg.to_dict())  # as config.yaml holds it
    check_same_request(run_dir, cfg.run.name, current, also_safe, trained)


def finished_at(cfg: C.Config, run_dir: Path) -> int | None:
    """The step a run in run_dir finished at, when resume=auto would only repeat it: its
    summary.json (written once all its steps are done) is of its newest checkpoint, and the
    config asks for no more steps or epochs than it trained. None: there is training to do."""
    summary_file = run_dir / "summary.json"
    if cfg.resume != "auto" or not summary_file.is_file():
        return None
    try:
        summary = json.loads(summary_file.read_text())
        steps, epochs = int(summary["steps"]), int(summary["epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: resuming decides from the checkpoints
    newest = ckpt.list_checkpoints(run_dir / "checkpoints")
    if not newest or ckpt.step_of(newest[0]) != steps:
        return None  # trained on after the summary (a longer run stopped early)
    wanted = cfg.train.max_steps
    done = steps >= wanted if wanted else epochs >= cfg.train.epochs
    return steps if done else None


def fit_watched(run: Run, holds_dir: bool) -> str | None:
    """fit_or_explain() under the hang watchdog (engine.hang, dist.hang_s): a rank that makes
    no progress ends the run in one line, which rank 0 also records as the run's failure."""
    said = (lambda why: record_failure(run, run.run_dir, RunError(why))) if holds_dir else None
    with hang.watch(run.run_dir, run.cfg.dist.hang_s, run.denv, said):
        return fit_or_explain(run)


def fit_or_explain(run: Run) -> str | None:
    """fit(), with a peer that hung or died turned from a transport error into a line that
    says what this rank was doing and what to look for."""
    try:
        reason = fit(run)
        checkpoint_state.finish_writing(run)  # ckpt.async_save: the last one published
        return reason
    except OSError as err:  # the run directory's disk is full, read-only or gone
        newest = ckpt.list_checkpoints(run.run_dir / "checkpoints")
        intact = f"{newest[0].name} is intact" if newest else "no checkpoint was saved"
        raise RunError(
            f"could not write {err.filename or 'in the run directory'}: {err.strerror or err}; "
            f"{intact}. Free space or fix permissions, then {resume_hint(run.cfg.run.name)} to "
            "resume"
        ) from None
    except torch.OutOfMemoryError:
        raise out_of_memory(run) from None
    except RuntimeError as err:
        text = str(err)
        if not run.denv.distributed or not any(p in text for p in PEER_FAILURES):
            raise
        what = (
            f"no answer from the other ranks within dist.timeout_s={run.cfg.dist.timeout_s:g}s"
            if "imed out" in text
            else "another rank closed its connection"
        )
        raise PeerFailure(
            f"rank {run.denv.rank}: {what} after step {run.progress.step} (in a collective: "
            "gradients, metrics, checkpoint or evaluation); a rank hung or died, see the "
            f"first failing rank's log; {resume_hint(run.cfg.run.name)} to resume"
        ) from None


def out_of_memory(run: Run) -> RunError:
    """One line for an out-of-memory error: where, and what to change; with prof.memory, the
    allocator's history written and named."""
    profiling = run.held.profiling
    snapshot = profiling.write_memory() if profiling is not None else None
    where = (
        f"the allocator's history is in {snapshot} (open it at pytorch.org/memory_viz)"
        if snapshot
        else "rerun with prof.memory=true to record the allocator's history"
    )
    return RunError(
        f"out of memory on {run.device} at step {run.progress.step + 1}: {where}; lower "
        "train.micro_batch_size (the global batch is kept by accumulation), or turn on "
        "train.activation_checkpointing or dist.strategy=fsdp"
    )


def conclude(run: Run, reason: str | None, seconds: float) -> int:
    """The end of a start that did not fail: the summary of a finished run, the state it
    ended in, and the exit code (75: preempted, the checkpoint saved)."""
    run.health.sum_replaced(run.device)
    if run.denv.is_main:
        finish(run, reason, seconds)
    run.records.tracker.close()
    code = preempt.EXIT_PREEMPTED if reason == "preempted" else 0
    record_state(run, "stopped" if reason else "finished", code, reason or "")
    return code


# Set by `make sweep` for its members (launch.sweep_members): a member goes on when its sweep
# is rerun, which runs what is left, not by a launch of its own name.
SWEEP_VARIABLE = "RECIPES_SWEEP"


def resume_hint(name: str) -> str:
    """How to go on with this run: rerun its sweep, or launch its name again."""
    sweep = os.environ.get(SWEEP_VARIABLE)
    if sweep:
        return f"rerun sweep {sweep} (the same make sweep command; it runs what is left)"
    return f"rerun with run.name={name}"


def record_state(run: Run, state: str, exit_code: int | None = None, why: str = "") -> None:
    """Rank 0: state.json, how the run's latest start stands (running, finished, stopped,
    failed), at which step of how many, with the exit code once it ended. `make status`
    reads it; a process killed outright leaves `running` behind a lock no one holds."""
    if why == "preempted":
        why = f"preempted: {', '.join(preempt.received()) or 'a signal to another rank'}"
    if run.denv.is_main:
        write_state(run.run_dir, state, run.progress.step, run.progress.total_steps, exit_code, why)


def write_state(
    run_dir: Path, state: str, step: int, steps: int | None, exit_code: int | None, why: str
) -> None:
    facts = {"state": state, "step": step, "steps": steps, "time": round(time.time(), 3)}
    if restarts := rundir.slurm_restarts():  # this start follows that many requeues
        facts["requeues"] = restarts
    if exit_code is not None:
        facts |= {"exit_code": exit_code, "why": why}
    ckpt.atomic_write_text(run_dir / rundir.STATE_NAME, json.dumps(facts) + "\n")


def record_failure(run: Run | None, run_dir: Path, err: BaseException) -> None:
    """Rank 0, on an error that ends its start: state.json says failed and why (a refused
    fresh launch, which leaves no run behind, says nothing); the log file gets the line."""
    if not rundir.holds_a_run(run_dir):
        return
    code = 2 if isinstance(err, C.ConfigError) else 130 if isinstance(err, KeyboardInterrupt) else 1
    why = redact(one_line_of(err))
    to_log_file(f"error: {why}")
    step, steps = (run.progress.step, run.progress.total_steps) if run is not None else (0, None)
    try:
        if not (run is None and code == 2 and note_refusal(run_dir, why)):
            write_state(run_dir, "failed", step, steps, code, why)
    except OSError:
        pass  # a full or read-only disk: the error that ends the run says so already


def note_refusal(run_dir: Path, why: str) -> bool:
    """A launch refused before it started (a config that drifted, a resume not allowed)
    changed nothing: the run stays as its last start left it (finished, stopped or failed),
    with the refused attempt beside it, not in its place. False: no such state to keep."""
    try:
        state = json.loads((run_dir / rundir.STATE_NAME).read_text())
    except (OSError, ValueError):
        return False
    if state.get("state") not in ("finished", "stopped", "failed"):
        return False
    state["refused"] = {"time": round(time.time(), 3), "exit_code": 2, "why": why}
    ckpt.atomic_write_text(run_dir / rundir.STATE_NAME, json.dumps(state) + "\n")
    return True


def one_line_of(err: BaseException) -> str:
    """The error as its message says it: the last line of a long one, a type for none."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    if isinstance(err, RunError | C.ConfigError) and lines:
        return lines[-1]
    return f"{type(err).__name__}: {lines[-1]}" if lines else type(err).__name__


def finish(run: Run, reason: str | None, seconds: float) -> None:
    """Rank 0: how the run ended, and summary.json for a finished run."""
    st = run.progress
    if reason:
        cause = ", ".join(preempt.received()) or "a signal to another rank"
        why = f"{reason}: {cause}" if reason == "preempted" else reason
        log(
            f"stopped at step {st.step} ({why}); checkpoint saved. Resume: "
            f"{resume_hint(run.cfg.run.name)}"
        )
        return
    ev, task = run.records.last_eval, run.task
    metrics = {summary_name(k): ev[k] for k in metric_names(ev)}
    metrics = {k: v for k, v in metrics.items() if k not in ("kind", "step", "epoch")}
    facts = task_facts(task.headline, task.higher_is_better, task.unit)
    summary = metrics | {"headline": facts["headline"], "higher_is_better": task.higher_is_better}
    summary |= {
        "seconds": seconds,
        "steps": st.step,
        "epochs": st.epoch,
        "world_size": run.denv.world_size,
        "code": run.records.code,
        "data": fingerprint.brief(run.records.data),
    }
    if run.net.init_record:
        summary["init"] = run.net.init_record
    if run.health.skip_bad:
        summary["bad_samples"] = run.health.bad_samples
        log(f"skipped {run.health.bad_samples} unreadable training samples (data.skip_bad)")
    summary["best_checkpoints"] = best.summary(run)  # best first, paths in the run directory
    ckpt.atomic_write_text(run.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    log(
        f"{run.cfg.recipe}: {task.describe(ev)} in {seconds:.1f}s, {st.step} steps; run dir {run.run_dir}"
    )
