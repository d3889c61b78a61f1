"""Hang diagnostics: a rank whose training makes no progress for dist.hang_s seconds writes
every thread's Python stack into <run dir>/hang/, one line names the rank(s) behind and the
step, and the run exits 1 instead of sitting until the scheduler's time limit.

Progress costs the training thread no system call: beat() (the loop's steps, evaluations
and checkpoints, the same sequence on every rank) and touch() (each evaluation batch) only
replace a tuple or add to an int. A watchdog thread per rank reads them every tick (a tenth
of hang_s, at most 5 s), and with several ranks writes hang/heartbeat-rank<r>.json (replaced
whole) when they moved: at most one small file per tick, none while nothing moves.

When its own progress has not moved for hang_s and no other rank's heartbeat moved either,
a rank's watchdog dumps the stacks of its threads (faulthandler, from this thread: a main
thread stuck in Python or in a blocking call keeps none from running) to hang/rank<r>.txt,
with NCCL the flight recorder's record to hang/nccl_trace_rank<r>.pkl, and asks every rank
to do the same (hang/dump-requested, read at each tick). The ranks that passed the fewest
marks are those behind: they did not reach the collective the others wait in. The lowest
rank that dumped prints the one line; every rank then exits with HANG_EXIT. The run
directory is on a file system every node sees, as checkpoints already require.

The watch starts with the loop and is armed at this process's first finished step: the
first step's compilation and the loader's start-up are not timed (dist.timeout_s bounds
them)."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from engine import distributed as D
from engine.atomic import atomic_write_text

FOLDER = "hang"  # in the run directory
REQUEST = "dump-requested"  # a rank found a hang: every rank dumps its stack
REPORTED = "reported"  # the line is out: the other ranks may exit
HANG_EXIT = 1  # a run stopped on a fault (README's exit codes)
ARMED_AT = 2  # marks passed once the first step finished: its start and its end
STDERR = 2  # the descriptor: the line is written with one os.write


class _Progress:
    """Written by the training thread, read by the watchdog: each a single assignment."""

    def __init__(self) -> None:
        self.mark: tuple[int, str, int] = (0, "start", 0)  # (marks passed, what, step)
        self.touches = 0


_progress = _Progress()


def beat(what: str, step: int) -> None:
    """A mark every rank passes in the same order, placed before the loop's collectives:
    ("step", n) as step n starts, ("after step", n) once it ended, ("stop check", n) before
    the ranks agree on a stop signal, ("evaluation", n), ("checkpoint", n)."""
    _progress.mark = (_progress.mark[0] + 1, what, step)


def touch() -> None:
    """Progress that is not a mark (an evaluation batch: ranks may hold different counts)."""
    _progress.touches += 1


def reset() -> None:
    global _progress
    _progress = _Progress()


def where(what: str, step: int) -> str:
    """Where a rank stopped: 'after step 3', 'in step 4', 'in the evaluation at step 4'."""
    if what == "after step":
        return f"after step {step}"
    if what == "step":
        return f"in step {step}"
    if what == "start":
        return "before its first step"
    if what == "stop check":
        return f"in the stop-signal check after step {step}"
    return f"in the {what} at step {step}"


def target(what: str, step: int) -> str:
    """Where a rank waits, as the place the ranks behind did not reach."""
    if what == "after step":
        return f"the end of step {step}"
    return where(what, step).removeprefix("in ")


def ranks(numbers: list[int]) -> str:
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(map(str, sorted(numbers)))


def describe(beats: dict[int, dict | None], world: int, hang_s: float, folder: Path) -> str:
    """The one line: who is behind, where, and what to read. beats: each rank's heartbeat
    (None: unreadable or absent)."""
    known = {r: b for r, b in beats.items() if b}
    quiet = f"no progress for {hang_s:g}s, dist.hang_s"
    resume = f"rerun with run.name={folder.parent.name} to resume from its last checkpoint"
    if world == 1 or len(known) < 2:
        mine = known.get(0) or next(iter(known.values()), {"what": "start", "step": 0})
        stopped = where(mine["what"], mine["step"])
        read = f"{folder}/rank{next(iter(known), 0)}.txt"
        return f"hang: {quiet}, {stopped}; every thread's Python stack is in {read}; {resume}"
    marks = {r: b["marks"] for r, b in known.items()}
    low, high = min(marks.values()), max(marks.values())
    behind = [r for r, m in marks.items() if m == low]
    first = known[behind[0]]
    if low == high:
        head = (
            f"hang: every rank stopped {where(first['what'], first['step'])} ({quiet}), none "
            "behind the others: a deadlock, or a collective that never completes"
        )
    else:
        ahead = [r for r, m in marks.items() if m == high]
        last = known[ahead[0]]
        head = (
            f"hang: {ranks(behind)} stopped {where(first['what'], first['step'])} and did not "
            f"reach {target(last['what'], last['step'])}, where {ranks(ahead)} "
            f"{'waits' if len(ahead) == 1 else 'wait'} ({quiet})"
        )
    notes = []
    if missing := [r for r in range(world) if r not in known]:
        notes.append(f"no heartbeat from {ranks(missing)}")
    if silent := [r for r in range(world) if not (beats.get(r) or {}).get("dumped")]:
        notes.append(f"no stack from {ranks(silent)}")
    read = (
        f"every rank's Python stack is in {folder}/, {ranks(behind[:1])}'s in rank{behind[0]}.txt"
    )
    return "; ".join([head, *notes, read, resume])


class Watchdog:
    """One rank's watch (see the module's docstring). isolate=False (tests): stderr is left
    as it is and self.exit_code is set instead of ending the process."""

    def __init__(
        self,
        folder: Path,
        hang_s: float,
        rank: int = 0,
        world: int = 1,
        report: Callable[[str], None] | None = None,
        nccl: bool = False,
        isolate: bool = True,
    ) -> None:
        self.folder, self.hang_s, self.rank, self.world = folder, hang_s, rank, world
        self.report, self.nccl, self.isolate = report, nccl, isolate
        self.tick = min(max(hang_s / 10, 0.05), 5.0)
        self.grace = max(5.0, 3 * self.tick)  # for the other ranks' stacks, then the line
        self.line: str | None = None
        self.exit_code: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.grace * 3 + self.tick)

    # ------------------------------------------------------------ the watchdog thread

    def _watch(self) -> None:
        seen, since = None, time.monotonic()
        while not self._stop.wait(self.tick):
            if self.world > 1 and (self.folder / REQUEST).exists():
                return self._fire(time.monotonic() - since)
            now = (_progress.mark, _progress.touches)
            if now != seen:
                seen, since = now, time.monotonic()
                self._heartbeat(now[0])
                continue
            idle = time.monotonic() - since
            if now[0][0] >= ARMED_AT and idle >= self.hang_s and not self._others_moved():
                return self._fire(idle)
        return None

    def _path(self, rank: int) -> Path:
        return self.folder / f"heartbeat-rank{rank}.json"

    def _heartbeat(self, mark: tuple[int, str, int], dumped: bool = False) -> None:
        if self.world == 1:
            return
        marks, what, step = mark
        facts = {"rank": self.rank, "marks": marks, "what": what, "step": step}
        facts |= {"time": round(time.time(), 3), "host": D.host_name(), "pid": os.getpid()}
        with contextlib.suppress(OSError):  # a full disk: the run's own writes say so
            atomic_write_text(self._path(self.rank), json.dumps(facts | {"dumped": dumped}) + "\n")

    def _read(self, rank: int) -> dict | None:
        try:
            return json.loads(self._path(rank).read_text())
        except (OSError, ValueError):
            return None

    def _others_moved(self) -> bool:
        """Another rank's heartbeat moved within hang_s (e.g. rank 0 alone writing files
        while the others wait for it): not a hang yet."""
        recent = time.time() - self.hang_s
        others = (self._read(r) for r in range(self.world) if r != self.rank)
        return any(b and not b.get("dumped") and b.get("time", 0) > recent for b in others)

    def _fire(self, idle: float) -> None:
        mark = _progress.mark
        with contextlib.suppress(OSError):
            self.folder.mkdir(mode=0o755, parents=True, exist_ok=True)
            self._dump(mark, idle)
        self._heartbeat(mark, dumped=True)
        out = STDERR
        if self.world > 1:
            with contextlib.suppress(OSError):
                atomic_write_text(self.folder / REQUEST, f"{self.rank}\n")
            out = self._quiet()
            self._wait(lambda: all((self._read(r) or {}).get("dumped") for r in range(self.world)))
        beats = {r: self._read(r) for r in range(self.world)}
        if self.world == 1:
            beats = {0: {"marks": mark[0], "what": mark[1], "step": mark[2], "dumped": True}}
        dumped = [r for r, b in beats.items() if b and b.get("dumped")]
        if min(dumped, default=self.rank) == self.rank:
            self.line = describe(beats, self.world, self.hang_s, self.folder)
            os.write(out, f"error: {self.line}\n".encode())
            if self.report is not None:
                with contextlib.suppress(Exception):
                    self.report(self.line)
            with contextlib.suppress(OSError):
                atomic_write_text(self.folder / REPORTED, f"{self.rank}\n")
        else:
            self._wait(lambda: (self.folder / REPORTED).exists())
        self._end()

    def _dump(self, mark: tuple[int, str, int], idle: float) -> None:
        """Every thread's Python stack (and NCCL's flight recorder) into the folder, each
        file replaced whole: a file there is complete."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        head = (
            f"rank {self.rank} of {self.world}, pid {os.getpid()} on {socket.gethostname()}, "
            f"{stamp}: no progress for {idle:.0f}s, {where(*mark[1:])}\n\n"
        )
        path = self.folder / f"rank{self.rank}.txt"
        tmp = path.with_name(f".{path.name}.part")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, head.encode())
            faulthandler.dump_traceback(fd, all_threads=True)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if self.nccl:
            with contextlib.suppress(Exception):  # no recorder in this build: the stack stays
                record = torch._C._distributed_c10d._dump_nccl_trace()
                trace = self.folder / f"nccl_trace_rank{self.rank}.pkl"
                fd = os.open(trace, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(record)

    def _wait(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.grace
        while not done() and time.monotonic() < deadline:
            time.sleep(min(self.tick, 0.2))

    def _quiet(self) -> int:
        """Where the line goes: stderr as it is now. The process's own stderr then goes
        nowhere, so the errors of a main thread whose peers exit (connection closed) never
        follow the line."""
        if not self.isolate:
            return STDERR
        saved = os.dup(STDERR)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, STDERR)
        os.close(null)
        return saved

    def _end(self) -> None:
        self.exit_code = HANG_EXIT
        if self.isolate:
            os._exit(HANG_EXIT)  # the main thread is stuck: no exception could end it


@contextlib.contextmanager
def watch(
    run_dir: Path,
    hang_s: float,
    denv: D.DistEnv,
    report: Callable[[str], None] | None = None,
) -> Iterator[Watchdog | None]:
    """The watchdog around the training loop (a collective with several ranks: call it on
    all); hang_s=0 starts no thread. report(line) is called where the line is printed."""
    reset()
    folder = run_dir / FOLDER
    if denv.distributed:  # where heartbeats and NCCL's own dumps (the launcher's setting) go
        folder.mkdir(mode=0o755, exist_ok=True)
        mine = [f"heartbeat-rank{denv.rank}.json"] + ([REQUEST, REPORTED] if denv.is_main else [])
        for stale in mine:  # a previous start's
            (folder / stale).unlink(missing_ok=True)
        D.broadcast_object(None)  # none reads a stale request once every rank is past here
    if hang_s <= 0:
        yield None
        return
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    dog = Watchdog(folder, hang_s, denv.rank, denv.world_size, report, nccl)
    dog.start()
    try:
        yield dog
    finally:
        dog.stop()
