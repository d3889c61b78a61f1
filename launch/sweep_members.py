"""A sweep's members: every cell of a grid (launch.grid) times seeds 0..N-1, planned
(launch.sweep_plan), recorded and run; the report that judges the cells is
launch.analysis.sweep's, which drives this module.

    make sweep ARGS="optim.lr=0.05,0.1,0.2 mix.mixup_alpha=0,0.2 run.name=lr" SEEDS=3
    make sweep SWEEP=sweeps/lr.yaml TARGET=submit PARALLEL=4

Locally the members run one after the other, seed-major (every cell's seed 0 before any seed
1: a sweep stopped half-way has seen every cell); under SLURM they are one job array with at
most PARALLEL tasks at once. Everything lands in `<run root>/<recipe>/<name>-sweep/`:
sweep.json (the grid, the command, the git SHA, each member's last attempt), report.md,
report.json, chart.png, and logs/ (local members' output).

Rerunning the same sweep runs only what is missing or unfinished: finished members are
kept, a stopped or preempted one resumes from its checkpoint (its run name is the same), a
member whose SLURM task is still queued is left to it. A different grid under the same name
is refused in one line naming the difference.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import rundir
from engine.redact import redact
from launch import check, grid, render, request, snapshot, watch
from launch.errors import UserError
from launch.render import LaunchRequest
from launch.runs import FINISHED, Member, read_json
from launch.sweep_plan import MANIFEST, Plan, Planned

# The request variables a sweep's command is rebuilt from (report.json's "command").
COMMAND_VARS = (
    "RECIPE CONFIG SWEEP SEEDS BASELINE GPUS NODES PROCS TARGET PARALLEL PARTITION ACCOUNT "
    "QOS TIME_MIN CPUS_PER_TASK MEM_GB CONSTRAINT EXCLUDE ARGS"
).split()
WAIT_POLL_S = 5.0  # squeue asked this often while a submitted array is waited for
RESULT_GRACE_S = 10.0  # the tasks' result files awaited this long once they left the queue
# SLURM states of a task ended from outside (scancel, preemption, its time limit, a node):
# its code wrote no result file, so none is awaited; nor for the engine's exit 75 (stopped
# with a checkpoint: it leaves submitit's task by SystemExit, which writes no result).
ENDED_FROM_OUTSIDE = ("CANCELLED", "PREEMPTED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")
LIVE_STATES = (
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
)


# ---------------------------------------------------------------- sweep.json


def git_state() -> dict[str, Any]:
    status = request.git(request.ROOT, "status", "--porcelain")
    sha = request.git(request.ROOT, "rev-parse", "HEAD")
    return {"sha": sha, "dirty": None if status is None else bool(status)}


def command(env: Mapping[str, str], argv: list[str]) -> dict[str, Any]:
    """The command as typed (argv and the request variables set) and as one make line."""
    given = {k: env[k] for k in COMMAND_VARS if env.get(k)}
    words = ["make", "sweep", *(f"{k}={shlex.quote(v)}" for k, v in given.items())]
    return {"make": " ".join(words), "argv": ["python", "-m", "launch", *argv], "env": given}


def grid_text(the_grid: grid.Grid) -> dict[str, Any]:
    """The grid as a person reads it: key: [values], zipped keys joined by '+'."""
    axes = {"+".join(a.keys): ["/".join(p) for p in a.points] for a in the_grid.axes}
    return {
        "axes": axes,
        "fixed": list(the_grid.fixed),
        "baseline": dict(the_grid.baseline),
        "cells": [c.name or "(seeds only)" for c in the_grid.cells],
        "file": the_grid.source or None,
    }


def load_manifest(plan: Plan) -> dict[str, Any]:
    """The sweep's record; a different grid under the same name is one line, a smaller SEEDS
    another."""
    old = read_json(plan.folder / MANIFEST, []) or {}
    if old:
        said = grid.differences(old.get("identity", {}), plan.identity())
        if said:
            raise UserError(
                f"sweep {plan.name} already exists with another grid: {'; '.join(said)}; rerun it "
                f"as it was, or give the new grid a new name (run.name=...)"
            )
        if plan.seeds < old.get("seeds", 0):
            raise UserError(
                f"sweep {plan.name} has {old['seeds']} seeds; SEEDS={plan.seeds} would leave some "
                f"out: use SEEDS={old['seeds']} or more"
            )
    return old


def save_manifest(
    plan: Plan, old: Mapping[str, Any], env: Mapping[str, str], argv: list[str]
) -> dict:
    record = {  # redacted: ARGS may hold a pasted credential
        "sweep": plan.name,
        "recipe": plan.req.recipe,
        "config": plan.req.variant or None,
        "identity": plan.identity(),
        "grid": grid_text(plan.grid),
        "seeds": plan.seeds,
        "parallel": plan.parallel,
        "command": command(env, argv),
        "git": git_state(),
        "created": old.get("created") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "members": {p.req.run_name: {"cell": p.cell.name, "seed": p.seed} for p in plan.members},
        "attempts": dict(old.get("attempts") or {}),
    }
    record = redact(record)
    write_manifest(plan.folder, record)
    return record


def write_manifest(folder: Path, record: Mapping[str, Any]) -> None:
    """Written whole or not at all (a sweep killed while writing keeps the last record)."""
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f".{MANIFEST}.part"
    part.write_text(json.dumps(redact(record), indent=2) + "\n")  # never a pasted credential
    os.replace(part, folder / MANIFEST)


def saved_request(planned: Planned) -> str:
    """The request a member was trained or queued from: its run's config.yaml, else the
    frozen file its submission reads; "" for a member never started nor queued."""
    path = Path(planned.req.src) / planned.req.run_dir
    if (path / "config.yaml").is_file():
        return str(path / "config.yaml")
    frozen = read_json(path / rundir.SUBMITTED_NAME, []) or {}
    queued = Path(planned.req.src) / str(frozen.get("request") or "")
    return str(queued) if frozen.get("request") and queued.is_file() else ""


def check_members_unchanged(plan: Plan) -> None:
    """A sweep's identity is its members' resolved requests, not the files they name: a
    rerun that would train or pool a member from another request (a CONFIG file edited, a
    recipe's default changed) is refused with the difference, before anything runs."""
    pairs = [(p, saved) for p in plan.members if (saved := saved_request(p))]
    found = check.request_changes([(p.req, saved) for p, saved in pairs])
    for (planned, _), changes in zip(pairs, found, strict=True):
        if changes:
            raise UserError(
                f"sweep {plan.name}: member {planned.req.run_name} was trained or queued from "
                f"another request than this command gives ({', '.join(changes)}); its cell "
                "would pool two requests: go back to those values, or give the new request a "
                "new sweep name (run.name=...)"
            )


def restore_manifest(folder: Path, old: Mapping[str, Any]) -> None:
    """sweep.json as it was before a launch that queued nothing (none, for a new sweep)."""
    if old:
        write_manifest(folder, old)
    else:
        (folder / MANIFEST).unlink(missing_ok=True)


# ---------------------------------------------------------------- how members stand


def last_line(path: Path | None) -> str | None:
    """The member's own last line in its log (read from its last 64 KiB), not srun's or
    submitit's report that the task ended; None when there is none."""
    if path is None or not path.is_file():
        return None
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 65536))
        text = f.read().decode(errors="replace")
    own = "\n".join(line for line in text.splitlines() if not watch.WRAPPER_LINE.match(line))
    return check.last_line(own)[:300] or None


def held_of(found: Mapping[str, tuple[str, str]] | None) -> set[str]:
    """Of queue_states' tasks, those that wait for a person (`scontrol release`)."""
    return {job for job, (state, reason) in (found or {}).items() if watch.is_held(state, reason)}


def queue_states(attempts: Mapping[str, Mapping]) -> dict[str, tuple[str, str]] | None:
    """{task: (state, reason)} of the recorded SLURM array tasks still queued or running (held
    ones too: still in the queue, held_of names them); None where squeue cannot say (not on
    PATH here, or no controller answers)."""
    arrays = sorted({a["job"].split("_")[0] for a in attempts.values() if a.get("job")})
    if not arrays:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i %T %r", "-j", ",".join(arrays)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 and "invalid job id" not in out.stderr.lower():
        return None  # (an array SLURM has forgotten is an invalid id: none of it is live)
    rows = (line.split(maxsplit=2) for line in out.stdout.splitlines())
    return {
        r[0]: (r[1], r[2] if len(r) > 2 else "")
        for r in rows
        if len(r) >= 2 and r[1] in LIVE_STATES
    }


def stand(
    planned: Planned, src: Path, attempt: Mapping[str, Any], live: set[str] | None, held=frozenset()
) -> Member:
    path = src / planned.req.run_dir
    member = Member(planned.req.run_name, planned.seed, path)
    summary = read_json(path / "summary.json", [])
    log = Path(attempt["log"]) if attempt.get("log") else None
    if summary is not None:
        member.status, member.summary = FINISHED, summary
    elif attempt.get("job") and attempt["job"] in held:
        member.status, member.last_line = "held", f"held: scontrol release {attempt['job']}"
    elif attempt.get("job") and live is not None and attempt["job"] in live:
        member.status = "queued"
    elif attempt.get("job") and live is None:  # not known to have failed
        member.status, member.last_line = "unfinished", "squeue cannot say whether it is queued"
    elif failed(attempt, path, said := watch.failure_line({}, [log] if log else [])):
        member.status, member.last_line = "failed", said or last_line(log) or attempt.get("said")
    elif started(path):
        member.status, member.last_line = "unfinished", last_line(log)
    return member


def started(path: Path) -> bool:
    """The member's engine has started in its run directory (a submission alone writes its
    frozen config there)."""
    return any((path / name).exists() for name in ("config.yaml", rundir.STATE_NAME))


def failed(attempt: Mapping[str, Any], path: Path, error_line: str = "") -> bool:
    """Its last attempt exited non-zero, not because it was stopped (a signal, preemption), or
    its SLURM task left the queue without finishing it, after the engine started or with an
    error line in its log (a setup line that failed before it could)."""
    if attempt.get("stopped") or attempt.get("exit") == render.PREEMPTED:
        return False
    if attempt.get("exit") not in (None, 0):
        return True
    return bool(attempt.get("job") and (started(path) or error_line))


def standing(plan: Plan, attempts: Mapping[str, Mapping]) -> list[Member]:
    found = queue_states(attempts)  # one squeue for both
    live, held = (None if found is None else set(found)), held_of(found)
    src = Path(plan.req.src)
    return [stand(p, src, attempts.get(p.req.run_name, {}), live, held) for p in plan.members]


# ---------------------------------------------------------------- running members here


class Stop:
    """SIGINT and SIGTERM end the sweep: the member running now gets the signal once (it saves
    a checkpoint and exits), the next one is not started. The member runs in its own process
    group, so a Ctrl-C reaches it through here only, once."""

    def __init__(self):
        self.signum: int | None = None
        self.child: subprocess.Popen | None = None

    def __call__(self, signum, frame) -> None:
        self.signum = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def __enter__(self) -> Stop:
        self.old = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)


def run_member(planned: Planned, log: Path, stop: Stop, environ: Mapping[str, str]) -> int:
    """The member's engine command, its output shown on stderr and kept in its log."""
    argv = render.local(planned.req)
    print(f"+ {render.shell_join(argv)}", file=sys.stderr, flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as kept:
        child = subprocess.Popen(
            argv,
            cwd=request.ROOT,
            env={**os.environ, **environ},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
        stop.child = child
        for line in child.stdout:
            kept.write(line)
            kept.flush()
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
        rc = child.wait()
        stop.child = None
    return 128 - rc if rc < 0 else rc


def frozen_local(todo: list[Planned]) -> tuple[list[Planned], list[str]]:
    """(the members, each of several processes reading its frozen config; those configs'
    texts, "" for a one-process member, which resolves its own request as it starts). The
    configs are resolved in one engine process for all (launch.check.resolved_configs)."""
    several = [i for i, p in enumerate(todo) if not render.is_one_process(p.req)]
    resolved = check.resolved_configs([todo[i].req for i in several])
    configs = [""] * len(todo)
    for i, config in zip(several, resolved, strict=True):
        configs[i] = config
    pairs = zip(todo, configs, strict=True)
    return [replace(p, req=snapshot.freeze(p.req, c)) if c else p for p, c in pairs], configs


def run_local(
    plan: Plan, todo: list[Planned], record: dict, environ: Mapping[str, str]
) -> int | None:
    """Runs todo in order; returns the signal that stopped the sweep, if one did."""
    todo, configs = frozen_local(todo)
    with Stop() as stop:
        for i, planned in enumerate(todo, 1):
            if stop.signum is not None:
                break
            snapshot.write_frozen(planned.req, configs[i - 1])
            name = planned.req.run_name
            print(f"sweep {plan.name}: member {i}/{len(todo)}: {name}", file=sys.stderr, flush=True)
            log = plan.folder / "logs" / f"{name}.log"
            rc = run_member(planned, log, stop, environ)
            attempt = {"how": "local", "exit": rc, "log": str(log)}
            if stop.signum is not None:  # stopped, not failed: it resumes from its checkpoint
                attempt["stopped"] = signal.Signals(stop.signum).name
            record["attempts"][name] = attempt
            write_manifest(plan.folder, record)
        return stop.signum


# ---------------------------------------------------------------- SLURM


def frozen_array(plan: Plan, todo: list[Planned]) -> tuple[list[LaunchRequest], list[str]]:
    """(each member's request with the one snapshot of the code the array runs from, in the
    sweep's folder, and its own frozen config in its run directory; those configs' texts)
    (launch.snapshot)."""
    first = snapshot.attach(todo[0].req, str(plan.folder))
    reqs = [dataclasses.replace(p.req, code=first.code) for p in todo]
    configs = check.resolved_configs(reqs)
    return [snapshot.freeze(r, c) for r, c in zip(reqs, configs, strict=True)], configs


def run_slurm(
    plan: Plan, todo: list[Planned], record: dict, environ: dict[str, str], wait: bool
) -> None:
    slurm = check.slurm_support()
    reqs, configs = frozen_array(plan, todo)
    jobs = slurm.submit_array(
        reqs, configs, plan.folder / "slurm", plan.name, environ, plan.parallel
    )
    for r, job in zip(reqs, jobs, strict=True):
        record["attempts"][r.run_name] = {
            "how": "slurm",
            "job": job.job_id,
            "log": str(job.paths.stderr),
        }
        print(f"submitted {job.job_id}: {r.run_name}  (log {job.paths.stderr})")
    write_manifest(plan.folder, record)
    if not wait:
        return
    held = wait_for_array(plan, reqs, jobs)
    deadline = time.monotonic() + RESULT_GRACE_S  # a slow shared filesystem shows them late
    for r, job in zip(reqs, jobs, strict=True):
        if job.job_id not in held:  # still in the queue, waiting for a person
            record["attempts"][r.run_name] |= task_outcome(plan, r.run_name, job, deadline)
    write_manifest(plan.folder, record)


def wait_for_array(plan: Plan, reqs: list[LaunchRequest], jobs: list[Any]) -> set[str]:
    """Until no task of the array is queued or running (a held one is said and left: it
    waits for `scontrol release`), asked of squeue, which needs no
    accounting database. submitit's own wait asks sacct: without slurmdbd it warns at every
    poll, and a task that ended without a result file (stopped, preempted for good) keeps
    it waiting for ever. Where squeue cannot answer, a warning once, and it asks again."""
    waiting = {job.job_id: r.run_name for r, job in zip(reqs, jobs, strict=True)}
    warned, held = False, set()
    while waiting:
        found = queue_states({name: {"job": job} for job, name in waiting.items()})
        live = None if found is None else set(found)
        if live is None and not warned:
            print(
                f"launch: warning: sweep {plan.name}: squeue cannot say which members are "
                "still queued or running; asking again every "
                f"{WAIT_POLL_S:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            warned = True
        if live is not None:
            waiting = {job: name for job, name in waiting.items() if job in live}
        for job in held_of(found) & waiting.keys():
            held.add(job)
            print(
                f"launch: sweep {plan.name}: member {waiting.pop(job)} (job {job}) is held: "
                f"scontrol release {job} starts it again",
                file=sys.stderr,
                flush=True,
            )
        if waiting:
            time.sleep(WAIT_POLL_S)
    return held


def task_outcome(plan: Plan, name: str, job: Any, deadline: float) -> dict[str, Any]:
    """How an array task that left the queue ended: its result file (awaited until
    `deadline`) says finished or failed (with the error); none means the member stopped
    before its end (make cancel, a preemption not requeued), said in one line: rerunning the
    sweep resumes it."""
    result, log = job.paths.result_pickle, Path(job.paths.stderr)
    ended = job_end(job.job_id)
    if (
        ended.startswith(ENDED_FROM_OUTSIDE)
        or ended.endswith(f"exit {render.PREEMPTED}")
        or not log.exists()  # it never started (cancelled while queued): no result coming
    ):
        deadline = time.monotonic()
    said = ""
    while not result.exists() and time.monotonic() < deadline:
        said = watch.failure_line({}, [log])
        if said.startswith(render.SETUP_FAILED):  # the script ended before any task ran
            break
        time.sleep(0.5)
    if not result.exists() and (said := said or watch.failure_line({}, [log])):
        return {"exit": 1, "said": said}  # the engine never said (a setup line failed)
    if not result.exists():
        print(
            f"launch: sweep {plan.name}: member {name} (job {job.job_id}) ended without "
            f"finishing ({ended}); {plan.rerun} to run it again (from its checkpoint, if any)",
            file=sys.stderr,
            flush=True,
        )
        return {"stopped": ended}
    try:
        job.result()
    except Exception as e:  # submitit re-raises the task's failure here
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"exit": 1, "said": said}
    return {"exit": 0}


def job_end(job_id: str) -> str:
    """`JobState, exit N` as scontrol still tells it, else that it no longer knows."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"ExitCode=(\d+):", out)
    if not state:
        return "SLURM no longer knows the task"
    return f"{state[1]}, exit {code[1]}" if code else state[1]


# ---------------------------------------------------------------- what is left


def outcome(plan: Plan, found: list[Member]) -> int:
    """0 when every member finished; else one line of what is left and how to finish it."""
    left = [m for m in found if not m.finished]
    if not left:
        return 0
    counts = {
        s: sum(m.status == s for m in left)
        for s in ("failed", "held", "unfinished", "queued", "missing")
    }
    said = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    failure = next((m for m in left if m.status in ("failed", "held") and m.last_line), None)
    why = f"; {failure.name}: {failure.last_line}; fix that, then" if failure else ";"
    print(
        f"launch: sweep {plan.name}: {len(found) - len(left)} of {len(found)} members finished "
        f"({said}){why} {plan.rerun} to run the rest",
        file=sys.stderr,
    )
    return 1


# ---------------------------------------------------------------- a launch


def to_run(plan: Plan, attempts: Mapping[str, Mapping]) -> tuple[list[Planned], list[Member]]:
    """(the members a launch runs now: neither finished nor queued, how every member stands)."""
    found = standing(plan, attempts)
    todo = [
        p
        for p, m in zip(plan.members, found, strict=True)
        if m.status not in (FINISHED, "queued", "held")
    ]
    return todo, found


def dry_run(plan: Plan) -> int:
    """What a launch would run now, checked as a launch checks it: a rerun's dry run leaves
    out what is finished or queued."""
    todo, _ = to_run(plan, load_manifest(plan).get("attempts") or {})
    check_members_unchanged(plan)
    if todo:
        check_cells(plan, todo, data_here=False)
    for line in plan.req.warnings:  # after the checks: a warning never precedes an error
        print(line, file=sys.stderr)
    if not todo:
        print(f"# sweep {plan.name}: every member is finished or queued; nothing to run")
    elif plan.slurm:  # the one job array submitit would submit
        slurm = check.slurm_support()
        reqs, _ = frozen_array(plan, todo)
        print(slurm.dry_run(reqs, plan.folder / "slurm", plan.name, plan.parallel), end="")
    else:
        for p in frozen_local(todo)[0]:
            print(render.shell_join(render.local(p.req)))
    return 0


def check_cells(plan: Plan, todo: list[Planned], data_here: bool = True) -> None:
    """The engine's check of enough members that every value of every axis is checked once
    (a value the engine refuses is one line before anything runs)."""
    seen: set[tuple[str, str]] = set()
    for planned in todo:
        if not set(planned.cell.settings) <= seen or not seen:
            check.engine_check(planned.req, data_here=data_here and not plan.slurm)
            seen |= set(planned.cell.settings)


class SweepLock:
    """One launch of a sweep at a time on this machine (a second is refused in one line). A
    sweep folder this launch made and left empty (a refused grid) is removed again."""

    def __init__(self, folder: Path):
        self.folder, self.made = folder, not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            name = folder.name.removesuffix("-sweep")
            raise UserError(
                f"sweep {name} is being run by another launch now; wait for it, or stop it "
                "and rerun"
            ) from None

    def __enter__(self) -> SweepLock:
        return self

    def __exit__(self, *exc) -> None:
        if self.made and [p.name for p in self.folder.iterdir()] == [".lock"]:
            (self.folder / ".lock").unlink()
            self.folder.rmdir()
        os.close(self.fd)


def group_environ(name: str) -> dict[str, str]:
    """The members share one W&B group, the sweep's name, unless WANDB_RUN_GROUP is set; each
    knows its sweep (a stopped member's hint is to rerun the sweep: engine.lifecycle)."""
    return {"WANDB_RUN_GROUP": os.environ.get("WANDB_RUN_GROUP") or name, "RECIPES_SWEEP": name}


def launch_members(
    plan: Plan, env: Mapping[str, str], argv: list[str], wait: bool
) -> tuple[dict[str, Any], int | None]:
    """Under the sweep's lock: the members neither finished nor queued, checked, then run here
    or submitted as one job array (wait: until it ends), each attempt recorded in sweep.json.
    Returns the record and the signal that stopped a local sweep, if one did."""
    old = load_manifest(plan)
    todo, found = to_run(plan, old.get("attempts") or {})
    check_members_unchanged(plan)
    for planned in todo:  # a member's name another submission's live job holds
        watch.check_no_live_job(Path(plan.req.src) / planned.req.run_dir, planned.req.run_name)
    if todo:  # before sweep.json is written: a grid the engine refuses can still be fixed
        check_cells(plan, todo)
    held = sum(m.status == "held" for m in found)
    said = (
        f"{len(plan.members) - len(todo) - held} of {len(plan.members)} members finished or queued"
    )
    said += f", {held} held" if held else ""
    print(f"sweep {plan.name}: {said}; {len(todo)} to run", file=sys.stderr, flush=True)
    record = save_manifest(plan, old, env, argv)
    stopped = None
    if todo and plan.slurm:
        try:
            run_slurm(plan, todo, record, group_environ(plan.name), wait=wait)
        except UserError:  # nothing queued: the sweep stays as it was (seeds, attempts)
            restore_manifest(plan.folder, old)
            raise
    elif todo:
        stopped = run_local(plan, todo, record, group_environ(plan.name))
    return record, stopped
