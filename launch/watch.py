"""`make status`, `make cancel RUN=...` (and `make logs RUN=...`, launch.logs): runs watched
and stopped without squeue, tail -f or a job id copied from a log.

What a run is doing is read from its folder and, for a SLURM job, from SLURM:

* the run lock (`.lock`, engine.rundir): held by a live run, with its holder's host, pid and
  SLURM job id;
* `state.json`: rank 0 writes it as training starts (`running`, the step of how many) and as
  it ends (`finished`, `stopped` with exit code 75 or after train.stop_at_step, `failed` with
  its error); a process killed outright leaves `running` behind a lock no one holds;
* `stop_requested`: written by `make cancel` before it signals the run;
* metrics.jsonl (the step, the last evaluation), summary.json (finished), checkpoints/;
* `<run>/slurm/`, where submitit writes each job's files named by its job id (the newest
  job is the run's), and `scontrol show job` while slurmctld remembers the job (MinJobAge
  after its end; there is no accounting database to ask later).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import rundir
from engine.results import metric_text
from launch import runs
from launch.errors import UserError, printable

LIVE = ("queued", "running", "requeued", "held")
# JobState values slurmctld reports (Slurm 22.05): waiting, and ended for good.
PENDING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD")
ENDED = {
    "COMPLETED": "finished",
    "CANCELLED": "stopped",
    "FAILED": "failed",
    "TIMEOUT": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "PREEMPTED": "failed",
}
JOB_FILE = re.compile(r"^(\d+)_")  # submitit's <job id>_submitted.pkl, <job id>_0_log.err, ...
JOB_ID = re.compile(r"\d+(_\d+)?")  # a job, or an array's task: <array>_<task>
# Written into the run directory at submission: the job (an array task as <array>_<task>) and
# its log files, so a member still queued is listed, watched and cancelled alone.
SUBMITTED = rundir.SUBMITTED_NAME
FROZEN_REQUEST = rundir.REQUEST_FOLDER  # launch.snapshot's folder of a run's frozen configs
LAST_LINE_WIDTH = 100
PREPARED_NOTE = "sbatch FILE submits it"
TAIL_LINES = 20


# ---------------------------------------------------------------- SLURM


class SlurmQueue:
    """SLURM as seen from here: `problem` says why it cannot be asked (no squeue on PATH, or
    squeue fails), once; jobs are read with `scontrol show job`."""

    def __init__(self):
        self._problem: str | None = None
        self._checked = False

    @property
    def problem(self) -> str | None:
        if not self._checked:
            self._checked = True
            self._problem = _probe()
        return self._problem

    def job(self, job_id: str) -> dict[str, str] | None:
        """The job as `scontrol show job` describes it; None when slurmctld no longer knows
        it (or SLURM cannot be asked)."""
        if self.problem:
            return None
        out = _run(["scontrol", "show", "job", "-o", job_id])
        if out is None or out.returncode != 0 or "JobState=" not in out.stdout:
            return None
        return dict(re.findall(r"(\S+?)=(\S*)", out.stdout.strip().splitlines()[0]))

    def scancel(self, *args: str) -> None:
        out = _run(["scancel", *args])
        if out is None:
            raise UserError(f"scancel {' '.join(args)} failed: no answer within 20 s", code=1)
        said = out.stderr.strip().splitlines()
        # Slurm 22.05 signals an array task whose array still has pending tasks, then exits
        # non-zero without a word: a silent exit is a signal delivered.
        if out.returncode != 0 and said:
            raise UserError(f"scancel {' '.join(args)} failed: {said[-1]}", code=1)


def _run(argv: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None


def _probe() -> str | None:
    if shutil.which("squeue") is None:
        return "squeue is not on PATH"
    out = _run(["squeue", "-h", "-o", "%i"])
    if out is None:
        return "squeue did not answer within 20 s"
    if out.returncode != 0:
        lines = [line.strip() for line in out.stderr.splitlines() if line.strip()]
        return f"squeue: {lines[-1] if lines else f'exit code {out.returncode}'}"
    return None


# ---------------------------------------------------------------- one run


@dataclass
class Status:
    path: str
    state: str
    job: str = ""
    nodes: str = ""
    step: int = 0
    steps: int | None = None
    eval: str = ""
    last_line: str = ""
    notes: list[str] = field(default_factory=list)
    pid: int | None = None  # the live rank 0 holding the run's lock
    host: str = ""  # its host
    in_slurm: bool = False  # that process is a SLURM job's

    def cells(self) -> list[str]:
        step = f"{self.step}/{self.steps}" if self.steps else str(self.step)
        state = self.state + (f" ({', '.join(self.notes)})" if self.notes else "")
        return [self.path, state, self.job or "-", self.nodes or "-", step, self.eval or "-"]


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def job_ids(run: Path) -> list[str]:
    """The SLURM jobs submitted for the run (submitit's files in <run>/slurm/), oldest first."""
    folder = run / "slurm"
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return []
    return sorted({m.group(1) for n in names if (m := JOB_FILE.match(n))}, key=int)


def job_order(job: str) -> tuple[int, int]:
    array, _, task = job.partition("_")
    return int(array), int(task or -1)


def record_submission(run: Path, job: Any, frozen: str = "") -> None:
    """SUBMITTED in the run directory, for a submitit job (an array task's id is
    <array>_<task>), with the frozen request it reads (launch.snapshot: the run's request
    until it starts and saves config.yaml)."""
    facts = {
        "job": str(job.job_id),
        "stdout": str(job.paths.stdout),
        "stderr": str(job.paths.stderr),
        "submitted": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if frozen:
        facts["request"] = frozen
    run.mkdir(parents=True, exist_ok=True)
    part = run / f".{SUBMITTED}.part"
    part.write_text(json.dumps(facts) + "\n")
    os.replace(part, run / SUBMITTED)


def live_job(run: Path, slurm: SlurmQueue | None = None) -> str:
    """The job recorded in the run directory while SLURM has it queued or running, as
    `<id> (<state>)`; "" for none (or where SLURM cannot be asked)."""
    job = str(read_json(run / SUBMITTED).get("job") or "")
    info = (slurm or SlurmQueue()).job(job) if JOB_ID.fullmatch(job) else None
    state = (info or {}).get("JobState", "")
    return f"{job} ({state})" if state and state not in ENDED else ""


def check_no_live_job(run: Path, name: str) -> None:
    """One name, one request: a submission under the name of a run whose job is still
    queued or running is refused, naming the job (the second would train another request
    in its place, or find its work done)."""
    live = live_job(run)
    if live:
        raise UserError(
            f"run.name={name} has a job queued or running, {live}; wait for it, stop it "
            f"(make cancel RUN={run}), or give this request another run.name; nothing was "
            "queued"
        )


def newest_job(run: Path, env: dict) -> str:
    """The run's latest SLURM job: the newest of its submissions (submitit's files in
    <run>/slurm/, SUBMITTED) and of the job that last started it (a batch script's job leaves
    no files in <run>/slurm/); "" for none."""
    recorded = read_json(run / SUBMITTED).get("job")
    ids = [*job_ids(run), str(env.get("slurm_job_id") or ""), str(recorded or "")]
    ids = [i for i in ids if JOB_ID.fullmatch(i)]
    return max(ids, key=job_order) if ids else ""


def started_at(holder: dict) -> float:
    """When the latest start took the lock (its holder's `since`); 0: never."""
    try:
        return time.mktime(time.strptime(holder["since"], "%Y-%m-%d %H:%M:%S"))
    except (KeyError, TypeError, ValueError, OverflowError):
        return 0.0


def stop_asked(run: Path, holder: dict) -> bool:
    """`make cancel` asked this start (or a job not yet started) to stop: a mark written
    after the latest start took the lock (a mark left from an earlier start is stale)."""
    try:
        marked = (run / rundir.STOP_NAME).stat().st_mtime
    except OSError:
        return False
    return int(marked) >= started_at(holder)


def scan_metrics(path: Path) -> tuple[int, dict | None]:
    """(the last step recorded, the last evaluation record), read from the end."""
    try:
        data = path.read_bytes()
    except OSError:
        return 0, None
    step, last_eval = 0, None
    for raw in reversed(data.split(b"\n")):
        record = runs._record(raw) if raw.strip() else None
        if record is None:
            continue
        if record["kind"] in ("train", "eval"):
            step = max(step, record["step"])
        if record["kind"] == "eval" and last_eval is None:
            last_eval = record
        if step and last_eval is not None:
            break
    return step, last_eval


def eval_text(summary: dict, env: dict, last_eval: dict | None) -> str:
    """The headline metric: summary.json's for a finished run, else the last evaluation's."""
    headline = runs.find_headline(summary or None, env, [last_eval] if last_eval else [])
    if summary and isinstance(summary.get(headline.key), int | float):
        return f"{headline.key} {metric_text(headline.key, summary[headline.key])}"
    if last_eval and isinstance(last_eval.get(headline.metric), int | float):
        value = metric_text(headline.key, last_eval[headline.metric])
        return f"{headline.key} {value} @{last_eval['step']}"
    return ""


def log_files(run: Path, job: str) -> list[Path]:
    """Where the run's lines are: the SLURM job's output files (every task's, on whichever
    node it ran: they are on the shared run folder), else rank 0's train.log."""
    if job:
        found = sorted((run / "slurm").glob(f"{job}_*_log.*"))
        recorded = read_json(run / SUBMITTED)
        if not found and recorded.get("job") == job:  # a sweep's member: in the sweep's folder
            found = [Path(recorded[k]) for k in ("stderr", "stdout") if recorded.get(k)]
            found = [p for p in found if p.is_file()]
        if found:
            return found
    log = run / rundir.LOG_NAME
    return [log] if log.is_file() else []


def last_lines(path: Path, count: int) -> list[str]:
    """The file's last `count` non-empty lines (a progress bar's \\r updates split too)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 64 * 1024, 0))
            data = f.read()
    except OSError:
        return []
    text = data.decode(errors="replace").replace("\r", "\n")
    return [line for line in text.split("\n") if line.strip()][-count:]


# What srun and submitit add around the engine's own lines (`srun: error: node1: task 0:
# Exited with exit code 75`): the engine's last line says why, theirs only that it ended.
WRAPPER_LINE = re.compile(r"^(srun: |slurmstepd: |submitit (INFO|WARNING|DEBUG|ERROR) \()")


def last_line(files: list[Path]) -> str:
    """The last line of the run's own (not srun's or submitit's) in the file written last."""
    dated = []
    for path in files:
        try:
            dated.append((path.stat().st_mtime, path))
        except OSError:
            continue
    for _, path in sorted(dated, reverse=True):
        lines = [line for line in last_lines(path, TAIL_LINES) if not WRAPPER_LINE.match(line)]
        if lines:
            return clip(printable(lines[-1].strip()))
    return ""


def status_of(text: str, slurm: SlurmQueue) -> Status:
    """One run's state, step, last evaluation and last log line."""
    run = Path(text)
    held, holder = rundir.lock_holder(run)
    env, summary = read_json(run / "env.json"), read_json(run / "summary.json")
    state_file = read_json(run / rundir.STATE_NAME)
    # A live holder names its own job (none: a local run); else the run's newest job.
    job = str(holder.get("slurm_job_id") or "") if held else newest_job(run, env)
    step, last_eval = scan_metrics(run / "metrics.jsonl")
    step = max(step, runs.newest_checkpoint_step(run / "checkpoints"))
    steps = state_file.get("steps") or runs.read_config(run / "config.yaml", []).get(
        "train.max_steps"
    )
    status = Status(text, "", job, step=step, steps=steps if isinstance(steps, int) else None)
    status.eval = eval_text(summary, env, last_eval)
    status.last_line = last_line(log_files(run, job))
    status.nodes = ",".join(env.get("hosts") or [])
    info = slurm.job(job) if job else None
    if info:
        status.nodes = info.get("NodeList", "") if info.get("NodeList") != "(null)" else ""
    decide(status, run, held, holder, state_file, summary, info, slurm)
    if status.state in ("failed", "unknown", "prepared"):  # the engine's words, not a wrapper's
        why = failure_line(state_file, log_files(run, job))
        if why:  # a job SLURM has forgotten that failed (in a setup line, a check) too
            status.state, status.last_line = "failed", clip(why)
            status.notes = [n for n in status.notes if n != PREPARED_NOTE]
    return status


def failure_line(state_file: dict, files: list[Path]) -> str:
    """Why the run failed, in the engine's words: the failure state.json records, else the
    last `error: ` line of its newest log (a refusal before the run directory was claimed,
    a setup line that failed on a node)."""
    if state_file.get("state") == "failed" and state_file.get("why"):
        return printable(f"error: {state_file['why']}")
    newest = max(files, key=modified, default=None)
    errors = [ln for ln in last_lines(newest, 200) if ln.startswith("error: ")] if newest else []
    return printable(errors[-1].strip()) if errors else ""


def modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def clip(text: str) -> str:
    return text if len(text) <= LAST_LINE_WIDTH else text[: LAST_LINE_WIDTH - 3] + "..."


def decide(
    status: Status,
    run: Path,
    held: bool,
    holder: dict,
    state_file: dict,
    summary: dict,
    info: dict | None,
    slurm: SlurmQueue,
) -> None:
    """The state: a live lock is a running run; else SLURM's word while it knows the job;
    else how the run's latest start ended, from its folder."""
    asked = stop_asked(run, holder)
    if held:
        status.state, status.pid, status.host = "running", holder.get("pid"), holder.get("host")
        status.in_slurm = bool(holder.get("slurm_job_id"))
        status.notes += ["stop requested"] if asked else []
        return
    job_state = (info or {}).get("JobState", "")
    if is_held(job_state, (info or {}).get("Reason", "")):  # waits for a person, not SLURM
        status.state = "held"
        status.notes.append(f"{info.get('Reason')}: scontrol release {status.job}")
        return
    if job_state in PENDING:
        requeued = int((info or {}).get("Restarts", "0") or 0) > 0 or job_state != "PENDING"
        status.state = "requeued" if requeued else "queued"
        reason = (info or {}).get("Reason", "None")
        status.notes += [reason] if reason not in ("None", "") else []
        status.notes += ["stop requested"] if asked else []
        return
    if job_state and job_state not in ENDED and job_state != "COMPLETING":
        status.state = "running"  # started, the engine not yet holding its run folder
        return
    status.state = ended_state(state_file, summary, asked, job_state)
    if job_state == "TIMEOUT":  # SLURM's SIGTERM at the limit reads "preempted: SIGTERM"
        status.notes.append(
            f"time limit {(info or {}).get('TimeLimit', '')} reached: raise TIME_MIN"
        )
    if status.state == "unknown" and (run / FROZEN_REQUEST).is_dir():
        status.state = "prepared"  # make sbatch's: frozen, but no job of it has started yet
        status.notes.append(PREPARED_NOTE)
    if status.state == "failed" and state_file.get("why"):
        status.notes.append(f"exit {state_file.get('exit_code')}")
    if isinstance(refused := state_file.get("refused"), dict):  # a later launch: changed nothing
        status.notes.append(f"a later launch was refused, exit {refused.get('exit_code')}")
    if status.state == "unknown" and status.job and slurm.problem:
        status.notes.append("SLURM not reachable")


def is_held(job_state: str, reason: str) -> bool:
    """A pending job that will never start by itself (held by hand, by an administrator, or
    by SLURM after a requeue that failed to launch: launch_failed_requeued_held)."""
    return job_state in PENDING and (job_state == "REQUEUE_HOLD" or "held" in reason.lower())


def ended_state(state_file: dict, summary: dict, asked: bool, job_state: str) -> str:
    """How a run that no process holds now ended."""
    recorded = state_file.get("state")
    if recorded in ("finished", "failed"):
        return recorded
    if recorded == "stopped" or asked:
        return "stopped"
    if recorded == "running":  # ended without a word: killed (SIGKILL, OOM, a lost node)
        return "stopped" if job_state == "CANCELLED" else "failed"
    if job_state:
        return ENDED.get(job_state, "failed")
    return "finished" if summary else "unknown"


# ---------------------------------------------------------------- which runs


def run_words(env: Mapping[str, str]) -> list[str]:
    """RUNS (paths or patterns), else every run under runs/<RECIPE or any>/*."""
    try:
        words = shlex.split(env.get("RUNS", ""))
    except ValueError as err:
        raise UserError(f"RUNS cannot be split into paths ({err}); check its quotes") from None
    if words:  # a sweep's folder is not a run: one named stands for its members
        paths = []
        for word in words:
            for path in runs.expand(word):
                if word == path:
                    paths += members_of_sweep(Path(path))
                elif not is_sweep(Path(path)):  # a pattern's sweep folders: their members match
                    paths.append(path)
        missing = [p for p in paths if not Path(p).is_dir()]
        if missing:
            raise UserError(f"RUNS: {missing[0]} is not a directory; give run directories")
        return paths
    recipe = env.get("RECIPE") or "*"
    return [str(p) for p in sorted(Path("runs").glob(f"{recipe}/*")) if looks_like_run(p)]


def is_sweep(path: Path) -> bool:
    return (path / "sweep.json").is_file()


def members_of_sweep(path: Path) -> list[str]:
    """A sweep folder's members that exist (beside it), in its order; [path] for a run."""
    if not is_sweep(path):
        return [str(path)]
    names = read_json(path / "sweep.json").get("members") or {}
    return [str(path.parent / n) for n in names if (path.parent / n).is_dir()]


def looks_like_run(path: Path) -> bool:
    """A run's folder (a sweep's folder, beside its members, holds sweep.json instead)."""
    if not path.is_dir() or (path / "sweep.json").exists():
        return False
    marks = (
        "metrics.jsonl",
        "config.yaml",
        rundir.LOCK_NAME,
        rundir.STATE_NAME,
        "slurm",
        SUBMITTED,
        FROZEN_REQUEST,
    )
    return any((path / mark).exists() for mark in marks)


def one_run(env: Mapping[str, str], command: str) -> str:
    text = env.get("RUN", "")
    if not text:
        raise UserError(f"{command} needs RUN=<run dir>, e.g. make {command} RUN=runs/digits/NAME")
    path = Path(text)
    if not path.is_dir():
        raise UserError(
            f"RUN={text} is not a directory; give a run directory, runs/<recipe>/<name>"
        )
    if is_sweep(path):
        members = members_of_sweep(path)
        example = f" (e.g. RUN={members[0]})" if members else ""
        raise UserError(
            f"RUN={text} is a sweep's folder, not a run: make status RUNS={text} lists its "
            f"{len(members)} member(s); make {command} RUN=<a member>{example}"
        )
    if not looks_like_run(path):
        raise UserError(f"RUN={text} is not a run directory (no config.yaml, lock or slurm/)")
    return text


# ---------------------------------------------------------------- the commands


HEADER = ["RUN", "STATE", "JOB", "NODES", "STEP", "EVAL"]


def status_main(env: Mapping[str, str]) -> int:
    paths = run_words(env)
    if not paths:
        where = f"runs/{env['RECIPE']}/" if env.get("RECIPE") else "runs/"
        print(f"no runs under {where}; make status RUNS='<run dir or pattern> ...'")
        return 0
    slurm = SlurmQueue()
    found = [status_of(path, slurm) for path in paths]
    if any(s.job for s in found) and slurm.problem:
        print(
            f"launch: SLURM is not reachable ({printable(slurm.problem)}); SLURM jobs' states "
            "below are read from their run folders alone",
            file=sys.stderr,
        )
    table = [HEADER + ["LAST LOG LINE"], *([*s.cells(), s.last_line or "-"] for s in found)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def cancel_main(env: Mapping[str, str]) -> int:
    """Stop a run as preemption does: a checkpoint at the next step boundary, then exit;
    `make status` says stopped."""
    text = one_run(env, "cancel")
    run, slurm = Path(text), SlurmQueue()
    status = status_of(text, slurm)
    if status.state not in LIVE:
        raise UserError(f"{text} is not running ({status.state}); nothing to stop")
    if status.job and (status.in_slurm or status.pid is None):
        return cancel_job(run, status, slurm)
    return cancel_local(run, status)


def mark_stop(run: Path, what: dict) -> None:
    facts = {"time": time.time(), "by": "make cancel", **what}
    (run / rundir.STOP_NAME).write_text(json.dumps(facts) + "\n")


def cancel_job(run: Path, status: Status, slurm: SlurmQueue) -> int:
    if slurm.problem:
        raise UserError(
            f"{run} is SLURM job {status.job}, but SLURM is not reachable ({slurm.problem}); "
            f"cancel it where squeue works: make cancel RUN={run}",
            code=1,
        )
    mark_stop(run, {"job": status.job})
    if status.pid is not None:  # the engine holds the run: its stop handlers are in place
        # TERM alone: the engine checkpoints at the next step and exits 75; launch.slurm's
        # EngineJob requeues only after SIGUSR2, so the job ends. No kill after it.
        slurm.scancel("--signal=TERM", status.job)
        print(
            f"asked SLURM job {status.job} to stop: it saves a checkpoint at the next step "
            f"boundary and ends; make status RUNS={run} will say stopped"
        )
        return 0
    # Queued, or started but its engine not yet holding the run (submitit's own handler
    # would ignore a TERM then): nothing trained in this job yet, nothing to save.
    slurm.scancel(status.job)
    print(f"cancelled SLURM job {status.job} ({status.state}); make status says stopped")
    return 0


def cancel_local(run: Path, status: Status) -> int:
    if status.pid is None or status.host != socket.gethostname():
        raise UserError(
            f"{run} is held by pid {status.pid} on host {status.host}, not this machine; "
            f"stop it there: make cancel RUN={run}",
            code=1,
        )
    mark_stop(run, {"pid": status.pid, "host": status.host})
    try:
        os.kill(int(status.pid), signal.SIGTERM)
    except ProcessLookupError:
        raise UserError(
            f"{run}: its process {status.pid} has just ended; see make status"
        ) from None
    print(
        f"asked pid {status.pid} to stop: it saves a checkpoint at the next step boundary and "
        f"exits; make status RUNS={run} will say stopped"
    )
    return 0
