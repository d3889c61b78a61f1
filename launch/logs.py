"""`make logs RUN=...` (FOLLOW=1: until the run ends) and the dispatch of the watch commands
(`make status`, `make cancel`: launch.watch, which reads how a run stands)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from engine import rundir
from launch.errors import UserError, printable
from launch.watch import (
    LIVE,
    TAIL_LINES,
    SlurmQueue,
    cancel_main,
    last_lines,
    log_files,
    one_run,
    status_main,
    status_of,
)

POLL_S = 0.5  # a followed log is read this often


def logs_main(env: Mapping[str, str]) -> int:
    text = one_run(env, "logs")
    run, slurm = Path(text), SlurmQueue()
    status = status_of(text, slurm)
    files = log_files(run, status.job)
    follow = env.get("FOLLOW", "") not in ("", "0")
    if not files and not follow:
        print(f"{text}: no log yet ({status.state}); a run logs to {rundir.LOG_NAME} or slurm/")
        return 0
    offsets = show_tails(files, TAIL_LINES)
    if follow:
        follow_logs(text, slurm, offsets)
    return 0


def show_tails(files: list[Path], count: int) -> dict[Path, int]:
    """Each file's last lines under a `==> file <==` header (as tail prints several);
    returns where each file ended, for following."""
    offsets = {}
    for path in files:
        if len(files) > 1:
            print(f"==> {path} <==")
        for line in last_lines(path, count):
            print(printable(line))
        offsets[path] = size_of(path)
    sys.stdout.flush()
    return offsets


def size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def follow_logs(text: str, slurm: SlurmQueue, offsets: dict[Path, int]) -> None:
    """New lines as they come, from every file of the run's latest job (a requeue or a task
    file that appears later too), until the run is no longer queued or running."""
    run, shown = Path(text), None
    live, checked, job = True, 0.0, ""
    while True:
        if time.monotonic() - checked > 2.0:
            status, checked = status_of(text, slurm), time.monotonic()
            live = status.state in LIVE
        else:
            status = None
        job = status.job if status else job
        for path in log_files(run, job):
            shown = print_new(path, offsets, shown, multiple=len(offsets) > 1)
        if not live:
            return
        time.sleep(POLL_S)


def print_new(path: Path, offsets: dict[Path, int], shown: Path | None, multiple: bool):
    """The complete lines written to `path` since its offset; returns the file shown last."""
    start = offsets.setdefault(path, 0)
    try:
        with path.open("rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return shown
    end = data.rfind(b"\n") + 1
    if end == 0:
        return shown
    offsets[path] = start + end
    if multiple and shown != path:
        print(f"==> {path} <==")
    for line in data[:end].decode(errors="replace").replace("\r", "\n").split("\n"):
        if line.strip():
            print(printable(line))
    sys.stdout.flush()
    return path


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    if args.overrides:
        raise UserError(
            f"{args.command} takes no arguments ({args.overrides[0]!r}); "
            f"use {'RUNS=' if args.command == 'status' else 'RUN='}"
        )
    return {"status": status_main, "logs": logs_main, "cancel": cancel_main}[args.command](env)
