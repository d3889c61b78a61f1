"""The training loop: step, epoch, fit, and one training process from start to summary.

`python -m engine.train RECIPE [key=value ...]` is the command line (engine.cli). A run is
assembled by engine.setup; evaluation, metering and checkpoints live in engine.evaluate,
engine.meter and engine.checkpoint.state."""

from __future__ import annotations

import json
import runpy
import time
from pathlib import Path

import torch
from torch import nn
from torch.profiler import record_function

from engine import checkpoint as ckpt
from engine import config as C
from engine import distributed as D
from engine import hang, preempt, rundir
from engine import parallel as P
from engine.checkpoint import best
from engine.checkpoint import state as checkpoint_state
from engine.data import fingerprint
from engine.data.stages import STAGES
from engine.ema import update_ema
from engine.evaluate import metric_names, run_eval
from engine.faults import RunError, inject_after_step, slow_data
from engine.meter import Meter
from engine.profile import Profiling
from engine.recipe import Recipe
from engine.redact import redact
from engine.results import summary_name, task_facts
from engine.run import Run
from engine.seeding import set_deterministic
from engine.setup import setup
from engine.tasks import check_supported, task_of
from engine.tracking import ProgressBar, log, log_to, to_log_file

PEER_FAILURES = ("Timed out", "timed out", "Connection closed by peer", "Connection reset")


class PeerFailure(RunError):
    """Reported by every rank that saw it (each says its own view)."""


# ---------------------------------------------------------------- one step


def train_step(run: Run, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro batches; returns the summed loss and the
    gradient norm (both detached, on the device: reading them would sync the host)."""
    accum = len(micro_batches)
    scale = run.denv.world_size / global_count(run, micro_batches)
    smoothing = run.cfg.train.label_smoothing
    total, device = None, run.device
    for j, batch in enumerate(micro_batches):
        x, y = run.to_device(batch.x, batch.y, run.feed.train_data)
        if run.feed.mix is not None:
            x, y = run.feed.mix(x, y, run.progress.epoch, micro_position(run, j))
        sync = P.gradient_sync(run.net.model, run.net.strategy, last=j == accum - 1)
        with sync, STAGES.device_time("forward_backward", device):
            with run.autocast(), record_function("forward"):
                # DDP and FSDP average gradients over ranks: x world size / global count
                # makes the step's gradient that of the loss summed over the global batch
                # divided by its count, for any world size and accumulation.
                loss = run.task.train_loss(run.net.model(x), y, smoothing) * scale
            if injected_nan(run):
                loss = loss * float("nan")
            with record_function("backward"):
                run.opt.scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    with record_function("optimizer"), STAGES.device_time("optimizer", device):
        norm = gradient_norm(run)
        if apply_step(run, norm):
            run.opt.scaler.step(run.opt.optimizer)
        run.opt.scaler.update()
        run.opt.optimizer.zero_grad(set_to_none=True)
        run.opt.scheduler.step()  # the schedule follows the step count, skipped steps included
        update_ema(run.net.ema, run.net.bare, run.progress.step + 1, run.cfg.ema)
    return total, norm


def global_count(run: Run, micro_batches: list) -> float | torch.Tensor:
    """The units the step's loss is normalised by, over all ranks and micro batches: the
    global batch for a per-sample task (no communication), else the targets' count summed
    over the ranks (e.g. tokens not ignored; a collective, on the device, without sync)."""
    counts = [run.task.count(b.y) for b in micro_batches]
    if counts[0] is None:
        return float(run.feed.sampler.plan.global_batch)
    total = torch.stack(counts).sum().to(run.device, torch.float32).reshape(1)
    return D.all_reduce_sum(total).clamp(min=1).reshape(())


def micro_position(run: Run, j: int) -> int:
    """The epoch position of micro batch j's first sample: the same for any world size."""
    plan = run.feed.sampler.plan
    return run.progress.position + run.denv.rank * plan.per_rank + j * plan.micro_batch


def injected_nan(run: Run) -> bool:
    fault = run.cfg.fault
    return fault.nan_at_step == run.progress.step + 1 and run.denv.rank == fault.rank


def gradient_norm(run: Run) -> torch.Tensor:
    """The total norm of the (unscaled, all-reduced) gradients, clipped when configured."""
    if run.opt.scaler.is_enabled():
        run.opt.scaler.unscale_(run.opt.optimizer)
    params = [p for p in run.net.trainable if p.grad is not None]
    # foreach: one batched norm kernel (by default CPU tensors get one norm call each)
    if run.cfg.train.grad_clip > 0:
        norm = nn.utils.clip_grad_norm_(params, run.cfg.train.grad_clip, foreach=True)
    else:
        norm = nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if run.net.strategy.shards:  # a DTensor over the shards: the norm of all of them
        norm = norm.full_tensor()
    return norm.detach()


def apply_step(run: Run, norm: torch.Tensor) -> bool:
    """Whether to take the optimizer step. fp16: the scaler skips non-finite steps itself.
    nan_policy=skip reads the norm (one host sync per step); stop takes the step and keeps
    the norm: the norms since the last check are checked together, on the device, before
    each log record and checkpoint (note_bad_steps), and read back there."""
    if run.opt.scaler.is_enabled():
        return True
    if run.cfg.train.nan_policy != "skip":
        run.health.unchecked_norms.append(norm)
        return True
    if torch.isfinite(norm).item():
        return True
    run.health.skipped_steps += 1
    log(f"warning: non-finite gradients at step {run.progress.step + 1}; step skipped")
    return False


def note_bad_steps(run: Run) -> None:
    """nan_policy=stop: the first step among the unchecked norms whose gradients were not
    finite into run.health.first_bad_step (unless one is there already): a few operations per
    window on the device, none per step, and no host sync (check_finite reads it)."""
    norms, run.health.unchecked_norms = run.health.unchecked_norms, []
    if not norms:
        return
    bad = ~torch.isfinite(torch.stack(norms))
    first = run.progress.step - len(norms) + 1  # the norms are those of the latest steps
    step = first + torch.argmax(bad.to(torch.uint8))  # argmax: the first of equal maxima
    new = bad.any() & (run.health.first_bad_step == 0)
    run.health.first_bad_step = torch.where(new, step, run.health.first_bad_step)


# ---------------------------------------------------------------- epochs


def train_epoch(run: Run, bar: ProgressBar) -> str | None:
    """Train to the end of the epoch; returns a reason when training must stop early."""
    cfg, st, plan = run.cfg, run.progress, run.feed.sampler.plan
    run.feed.sampler.set_epoch(st.epoch, st.position)
    meter = Meter(run.device)
    batches = iter(run.feed.loader)  # the batch sampler is read in this process, at iter()
    epoch_end = run.feed.epoch_samples()
    profiling = run.records.profiling
    while st.position < epoch_end and st.step < st.total_steps:
        if profiling is not None:
            profiling.step_begins(st.step + 1)
        micro = take_batches(run, batches, meter)
        hang.beat("step", st.step + 1)  # the watchdog's marks: no system call
        stepped = time.perf_counter()
        loss, norm = train_step(run, micro)
        meter.step += time.perf_counter() - stepped
        st.step += 1
        hang.beat("after step", st.step)
        st.position += plan.global_batch
        meter.add(loss, norm, plan.global_batch)
        if profiling is not None:
            profiling.step_ended(st.step)
        record = log_window(run, meter) if st.step % cfg.log.every_steps == 0 else None
        bar.update(st.step, record)
        reason = stop_reason(run)
        every = cfg.ckpt.every_steps
        if reason or (every and st.step % every == 0 and st.position < epoch_end):
            saving = time.perf_counter()
            checkpoint(run)
            meter.checkpoint += time.perf_counter() - saving
        if reason:
            return reason
    return None


def take_batches(run: Run, batches, meter: Meter) -> list:
    """The step's micro batches from the loader (the time blocked here is the window's data
    wait), noted where asked: their sample ids, their replaced samples."""
    waited = time.perf_counter()
    with record_function("data wait"):
        micro = [next(batches) for _ in range(run.feed.sampler.plan.accum_steps)]
        slow_data(run.cfg.fault)
    meter.wait += time.perf_counter() - waited
    if run.cfg.log.sample_ids:
        write_sample_ids(run, micro)
    if run.health.skip_bad:
        run.health.pending_bad += sum(int(b.replaced.sum()) for b in micro)
    return micro


def log_window(run: Run, meter: Meter) -> dict:
    """The logging window's record (a collective: the loss and the replaced-sample count
    summed over ranks), written; a non-finite step stops the run here. One host sync: the
    loss, that count, the gradient norm and the non-finite flag are read back together."""
    note_bad_steps(run)
    summed = meter.loss.detach().clone().reshape(1)
    if run.health.skip_bad:  # filled on the device from a host int: no copy from Python data
        summed = torch.cat([summed, summed.new_full((1,), float(run.health.pending_bad))])
    D.all_reduce_sum(summed)
    norm, bad = meter.grad_norm.detach(), run.health.first_bad_step != 0
    local = torch.stack([norm.to(summed.dtype), bad.to(summed.dtype)])
    synced = time.perf_counter()
    loss, *rest = torch.cat([summed, local]).tolist()  # waits for the device's queue
    meter.sync += time.perf_counter() - synced
    *count, grad_norm, bad = rest
    if bad:
        check_finite(run)
    if count:
        run.health.bad_samples += int(count[0])
        run.health.pending_bad = 0
    record = meter.record(run, loss, grad_norm)
    run.records.tracker.write(record)
    return record


def stop_reason(run: Run) -> str | None:
    inject_after_step(run.cfg.fault, run.progress.step, run.denv.rank)
    hang.beat("stop check", run.progress.step)  # before the agreement's collective
    stop_at = run.cfg.train.stop_at_step
    if stop_at and run.progress.step == stop_at and run.progress.step < run.progress.total_steps:
        return "stop_at_step"
    # Ranks agree on a preemption with a collective, at the steps where metrics are reduced
    # anyway: one more per step would cost a device sync on every step.
    if run.progress.step % run.cfg.log.every_steps == 0 and D.any_rank(
        preempt.stop_requested(), run.device
    ):
        return "preempted"
    return None


def write_sample_ids(run: Run, micro: list) -> None:
    ids = torch.cat([b.index for b in micro]).tolist()
    gathered = D.gather_objects(ids)
    if run.denv.is_main:
        with (run.run_dir / "samples.jsonl").open("a") as f:
            f.write(
                json.dumps({"step": run.progress.step, "ids": sorted(sum(gathered, []))}) + "\n"
            )


def train_steps(run: Run, steps: int, bar: ProgressBar | None = None) -> None:
    """`steps` more optimizer steps through the loop, crossing epoch ends as fit() does but
    without its evaluations and checkpoints: the step API of benchmarks and tests."""
    st = run.progress
    st.total_steps = st.step + steps
    bar = bar or ProgressBar(st.total_steps, st.step, "off", False)
    while st.step < st.total_steps:
        reason = train_epoch(run, bar)
        if reason:
            raise RunError(f"training stopped early at step {st.step}: {reason}")
        if st.position >= run.feed.epoch_samples():
            st.next_epoch()


def fit(run: Run) -> str | None:
    cfg, st = run.cfg, run.progress
    bar = ProgressBar(st.total_steps, st.step, cfg.log.progress, run.denv.is_main)
    profiling = Profiling(cfg.prof, run.denv.rank, run.denv.world_size, run.run_dir, run.device)
    run.records.profiling = profiling if profiling.active else None
    try:
        while st.step < st.total_steps:
            reason = train_epoch(run, bar)
            if reason:
                return reason
            if st.position >= run.feed.epoch_samples():
                end_epoch(run, bar)
        last = run.records.last_eval
        if not last or last.get("step") != st.step:
            run.records.last_eval = run_eval(run, bar)
            checkpoint(run)
        return None
    finally:
        bar.close()
        if run.records.profiling is not None:
            run.records.profiling.close()
            run.records.profiling = None


def end_epoch(run: Run, bar: ProgressBar) -> None:
    st = run.progress
    st.next_epoch()
    if st.epoch % run.cfg.eval.every_epochs == 0 or st.step >= st.total_steps:
        run.records.last_eval = run_eval(run, bar)
    checkpoint(run)


def checkpoint(run: Run) -> None:
    """Save the run (a collective), never weights that took a non-finite step."""
    hang.beat("checkpoint", run.progress.step)
    check_finite(run)
    flush_bad_count(run)
    checkpoint_state.save(run)


def check_finite(run: Run) -> None:
    """nan_policy=stop: never checkpoint (or go on from) weights that took a non-finite step."""
    note_bad_steps(run)
    bad = int(run.health.first_bad_step.item())
    if not bad:
        return
    newest = ckpt.list_checkpoints(run.run_dir / "checkpoints")
    kept = f"the last good checkpoint is {newest[0]}" if newest else "no checkpoint was saved"
    raise RunError(
        f"non-finite gradients at step {bad}; stopped without saving ({kept}). Continue from "
        f"it, skipping such steps, with run.name={run.cfg.run.name} train.nan_policy=skip, or "
        "start a new run with a lower optim.lr or train.grad_clip"
    )


def flush_bad_count(run: Run) -> None:
    """Sum the ranks' replaced-sample counts into the state (a collective with skip_bad)."""
    if not run.health.skip_bad:
        return
    pending = torch.full((1,), float(run.health.pending_bad), device=run.device)
    run.health.bad_samples += int(D.all_reduce_sum(pending).item())
    run.health.pending_bad = 0


# ---------------------------------------------------------------- one process


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
        lock, done = lock_run_dir(cfg, denv)
        if done is not None:
            return 0
        run = setup(cfg, recipe, denv, device)
        record_state(run, "running")
        reason = fit_watched(run, holds_dir=lock is not None)
        return conclude(run, reason, time.perf_counter() - started)
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


def lock_run_dir(cfg: C.Config, denv: D.DistEnv) -> tuple[int | None, int | None]:
    """(rank 0's lock on the run directory, the step the run there finished at or None).
    Taken before anything is said about the run (resuming it, or that it is done), so a
    second launch on a live run is refused first; set-up claims the same lock again."""
    run_dir = rundir.decide_run_dir(cfg.run.root, cfg.recipe, cfg.run.name)
    lock = D.on_main(lambda: rundir.acquire(run_dir))
    if lock is not None:
        log_to(run_dir / rundir.LOG_NAME)  # rank 0's lines, from here on, in its train.log
    done = D.broadcast_object(finished_at(cfg, run_dir) if denv.is_main else None)
    if done is not None and denv.is_main:
        log(
            f"run {run_dir} already finished at step {done}; nothing to do (start another "
            "with a new run.name)"
        )
    return lock, done


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
            f"{intact}. Free space or fix permissions, then rerun with "
            f"run.name={run.cfg.run.name} to resume"
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
            f"first failing rank's log. Rerun with run.name={run.cfg.run.name} to resume"
        ) from None


def out_of_memory(run: Run) -> RunError:
    """One line for an out-of-memory error: where, and what to change; with prof.memory, the
    allocator's history written and named."""
    profiling = run.records.profiling
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
    flush_bad_count(run)
    if run.denv.is_main:
        finish(run, reason, seconds)
    run.records.tracker.close()
    code = preempt.EXIT_PREEMPTED if reason == "preempted" else 0
    record_state(run, "stopped" if reason else "finished", code, reason or "")
    return code


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
            f"stopped at step {st.step} ({why}); checkpoint saved. Resume: rerun with "
            f"run.name={run.cfg.run.name}"
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


if __name__ == "__main__":
    # `python -m engine.train` is the documented command; the command line is engine.cli
    # (run as a module, not imported: the loop never depends on its command line).
    runpy.run_module("engine.cli", run_name="__main__", alter_sys=True)
