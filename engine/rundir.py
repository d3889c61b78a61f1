"""A run directory belongs to one job at a time, and a run in it is never silently erased.

The lock is an flock on `<run dir>/.lock`, taken by rank 0 before it writes anything and held
until the process ends: the kernel drops it when its holder dies (a crash, SIGKILL, a
preempted job), so a requeue is never blocked by its own dead predecessor, while a second
live launch (a double submission, a requeue racing the old job) is refused. flock works
across nodes on NFSv4 and Lustre mounted with flock support."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

from engine.config import ConfigError

LOCK_NAME = ".lock"
# What launch's status, logs and cancel read: how the run's latest start stands (rank 0 writes
# it as training starts and as it ends: engine.train), rank 0's log lines (engine.tracking),
# and the mark `make cancel` leaves before it signals the run.
STATE_NAME = "state.json"
LOG_NAME = "train.log"
STOP_NAME = "stop_requested"
TEMP_GLOB = ".step-*.tmp"  # checkpoint.atomic_save's partial files
PARTIAL_DIR_GLOBS = (".step-*.partial", ".step-*.old")  # checkpoint.sharded's directories


def decide_run_dir(root: str, recipe: str, name: str) -> Path:
    """The one rule for where a run lives, used by the engine and by launch alike:
    <run.root>/<recipe>/<run.name>."""
    return Path(root) / recipe / name


def decide_run_name(given: str, recipe: str, variant: str = "") -> str:
    """The one rule for a run's name: run.name as given, else a new name per launch: time
    stamp, recipe (and variant), and a random suffix (two launches in the same second never
    share a run directory). Launch decides it once, so every node and rank gets the same."""
    if given:
        return given
    what = f"{recipe}-{variant}" if variant else recipe
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{what}-{secrets.token_hex(2)}"


def run_config_of(weights: Path) -> Path | None:
    """The saved config.yaml of the run a path belongs to: the run directory itself, its
    checkpoints/ or best/ folder, or a checkpoint inside them; None for weights outside a run
    (an export, a downloaded file)."""
    for folder in [weights, *list(weights.parents)[:3]]:
        saved = folder / "config.yaml"
        try:
            if saved.is_file() and (folder / "checkpoints").is_dir():
                return saved
        except OSError:  # a name too long for the file system: no run there
            continue
    return None


def holds_a_run(run_dir: Path) -> bool:
    """Metrics or checkpoints from an earlier launch."""
    ckpts = run_dir / "checkpoints"
    # step-*: files and sharded directories (a partial one is hidden: .step-*.partial)
    return (run_dir / "metrics.jsonl").exists() or (ckpts.is_dir() and any(ckpts.glob("step-*")))


def check_fresh_start(run_dir: Path, resume: str, overwrite: bool) -> None:
    """resume=none must not mix a new run into an old one's metrics and checkpoints."""
    if resume == "none" and not overwrite and holds_a_run(run_dir):
        raise ConfigError(
            f"resume=none, but {run_dir} already holds a run; continue it with resume=auto, "
            "start another with a new run.name, or set run.overwrite=true to move its files "
            "aside and start afresh"
        )


def slurm_job(environ=os.environ) -> str | None:
    """This process's SLURM job as scancel and scontrol address it: `<array>_<task>` for an
    array task (its SLURM_JOB_ID alone may be the array's own id, which names every task:
    `scancel` of it stops the whole sweep), else SLURM_JOB_ID; None outside SLURM."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID")


def slurm_restarts(environ=os.environ) -> int:
    """How often SLURM has started this job again (requeued: preempted, a node lost, by
    hand); 0 for its first start and outside SLURM."""
    count = environ.get("SLURM_RESTART_COUNT", "")
    return int(count) if count.isdigit() else 0


def holder_description() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": slurm_job(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _describe(holder_text: str) -> str:
    try:
        h = json.loads(holder_text)
        job = f", SLURM job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
        return f"host {h['host']}, pid {h['pid']}{job}, since {h['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no description"


def lock_holder(run_dir: Path) -> tuple[bool, dict]:
    """(whether a live process holds the run's lock, the description its last holder wrote;
    {} for none). A probe: a shared lock taken and dropped at once, so a launch starting in
    that instant would be refused as if the run were live (a window of microseconds)."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False, {}
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            held = False
        except BlockingIOError:
            held = True
        text = os.pread(fd, 4096, 0).decode(errors="replace")
    finally:
        os.close(fd)
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    return held, holder if isinstance(holder, dict) else {}


def acquire(run_dir: Path) -> int:
    """Create the run directory and lock it; returns the descriptor to keep open (and give
    to release). Taken again by the process that holds it, it is the same descriptor: the
    engine locks before it says anything about the run, and set-up claims it after."""
    held = _held_here(run_dir)
    if held is not None:
        return held
    created = make_run_dir(run_dir)
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        remove_created(created)
        raise cannot_create(run_dir, err) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        raise ConfigError(
            f"{run_dir} is in use by another job ({_describe(holder)}); wait for it to end, "
            "cancel it, or launch with another run.name"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder_description()).encode(), 0)
    _HELD[fd] = (os.path.abspath(run_dir), created)
    return fd


def release(fd: int) -> None:
    """Let go of the run directory. One this process created that still holds nothing but
    its lock (a launch refused before it wrote anything) is removed, with the folders above
    it that were made for it."""
    run_dir, created = _HELD.pop(fd, ("", []))
    try:
        if created and [p.name for p in Path(run_dir).iterdir()] == [LOCK_NAME]:
            (Path(run_dir) / LOCK_NAME).unlink()
            remove_created(created)
    except OSError:
        pass  # gone or unreadable: nothing to tidy
    finally:
        os.close(fd)


# The run directories this process holds: {descriptor: (path, folders made for it)}.
_HELD: dict[int, tuple[str, list[Path]]] = {}


def _held_here(run_dir: Path) -> int | None:
    """This process's descriptor on the run directory's lock, if it holds it (and the
    descriptor still refers to that file)."""
    path = os.path.abspath(run_dir)
    for fd, (held, _) in list(_HELD.items()):
        if held != path:
            continue
        try:
            mine, there = os.fstat(fd), os.stat(Path(path) / LOCK_NAME)
        except OSError:
            mine = there = None
        if mine and (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
            return fd
        del _HELD[fd]  # closed behind rundir's back
    return None


def make_run_dir(run_dir: Path) -> list[Path]:
    """mkdir -p, returning the folders it made, outermost first; on failure none is left
    and the error says where a run can go instead."""
    missing = []
    for folder in [run_dir, *run_dir.parents]:
        if folder.is_dir():
            break
        missing.append(folder)
    created: list[Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            if folder.is_dir():  # made meanwhile by another launch
                continue
            remove_created(created)
            in_the_way = FileExistsError(errno.EEXIST, f"{folder} is a file, not a folder")
            raise cannot_create(run_dir, in_the_way) from None
        except OSError as err:
            remove_created(created)
            raise cannot_create(run_dir, err) from None
        created.append(folder)
    return created


def remove_created(created: list[Path]) -> None:
    """The folders make_run_dir made, innermost first, where still empty."""
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            return


def cannot_create(run_dir: Path, err: OSError) -> ConfigError:
    reason = err.strerror or str(err)
    return ConfigError(
        f"cannot create the run directory {run_dir} ({reason}); set run.root to a writable folder"
    )


# What a submission put in the run directory for the job running now (launch.snapshot's code
# and frozen request, submitit's logs, the job's record): its processes import from it and a
# requeue reads it, so run.overwrite leaves it where it is.
CODE_FOLDER, REQUEST_FOLDER, SLURM_FOLDER = "code", "request", "slurm"
SUBMITTED_NAME = "submitted.json"
SUBMISSION_ENTRIES = (CODE_FOLDER, REQUEST_FOLDER, SLURM_FOLDER, SUBMITTED_NAME)


def move_aside(run_dir: Path) -> Path:
    """run.overwrite: the earlier run's files go to a sibling folder, nothing is deleted (the
    lock and the submission's own files stay)."""
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    aside.mkdir()
    for entry in run_dir.iterdir():
        if entry.name != LOCK_NAME and entry.name not in SUBMISSION_ENTRIES:
            entry.rename(aside / entry.name)
    return aside


def remove_partial_checkpoints(folder: Path) -> list[Path]:
    """What writers that died left behind: atomic_save's temporary files, a sharded
    checkpoint's `.step-<n>.partial` directory, and a replaced or pruned one moved aside
    (`.step-<n>.old`). Safe only while holding the lock."""
    if not folder.is_dir():
        return []
    leftovers = sorted(folder.glob(TEMP_GLOB))
    for path in leftovers:
        path.unlink(missing_ok=True)
    dirs = sorted(p for glob in PARTIAL_DIR_GLOBS for p in folder.glob(glob) if p.is_dir())
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers + dirs
