"""Start-up: from `make train RECIPE=digits` (venv built) to the end of the first optimizer
step, as a user sees it: make, the launcher, python and torch imports, the recipe's data and
model, the engine's set-up, one step. Target: under 10 s.

Each launch runs `make train RECIPE=digits ARGS="train.max_steps=1 log.every_steps=1 ..."` as
a subprocess, its run directory in a temporary folder. The first step ends when its train
record appears in metrics.jsonl (the engine writes and flushes it right after the step;
polled every 10 ms from here, so the time is late by at most that and a file write); the
process goes on to evaluate and checkpoint, and its end is reported too. Median of 3.

measured = seconds to the first step; baseline = the 10 s budget; ratio = budget / measured,
so 1 (the target) is exactly on budget and 2 twice as fast as needed. For scale, the note
gives `python -c "import torch"` timed alongside: no torch program starts faster."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import result

REPO = Path(__file__).resolve().parent.parent
BUDGET_S = 10.0
POLL_S = 0.01
TIMEOUT_S = 120.0


def make(*args: str) -> list[str]:
    return ["make", "--no-print-directory", "-C", str(REPO), *args]


def environment() -> dict[str, str]:
    """This environment without DRY_RUN, which would print the command instead of running it."""
    return {k: v for k, v in os.environ.items() if k != "DRY_RUN"}


def has_first_step(metrics: Path) -> bool:
    return metrics.exists() and '"kind": "train"' in metrics.read_text()


def wait_for_first_step(proc: subprocess.Popen, metrics: Path, started: float) -> float | None:
    """Seconds from launch until the first train record appears (None: the process ended or
    timed out first)."""
    while proc.poll() is None and time.perf_counter() - started < TIMEOUT_S:
        if has_first_step(metrics):
            return time.perf_counter() - started
        time.sleep(POLL_S)
    return None


def launch(root: Path, name: str) -> tuple[float, float]:
    """(seconds to the first step, seconds to the end of the process) of one `make train`."""
    args = (
        "train.max_steps=1 log.every_steps=1 log.wandb=off log.progress=off "
        f"run.root={root} run.name={name}"
    )
    errors = root / f"{name}.stderr"
    argv = make("train", "RECIPE=digits", f"ARGS={args}")
    with errors.open("w") as err:
        started = time.perf_counter()
        # A session of its own, so that a launch that hangs is ended with everything it started.
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=err, env=environment(), start_new_session=True
        )
        first = wait_for_first_step(proc, root / "digits" / name / "metrics.jsonl", started)
        code = finish(proc)
        ended = time.perf_counter() - started
    if code != 0 or first is None:
        lines = errors.read_text().strip().splitlines() or ["no output"]
        raise RuntimeError(f"make train RECIPE=digits failed (exit {code}): {lines[-1]}")
    return first, ended


def finish(proc: subprocess.Popen) -> int | None:
    """The exit code; None when the launch outlived the timeout and was killed."""
    try:
        return proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def import_torch_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def run(quick: bool = False, smoke: bool = False) -> list[dict]:
    """quick and smoke: one launch instead of three."""
    launches = 1 if quick or smoke else 3
    subprocess.run(make("venv"), check=True, capture_output=True, env=environment())
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as folder:
        times = [launch(Path(folder), f"startup-{i}") for i in range(launches)]
    first = statistics.median(t[0] for t in times)
    ended = statistics.median(t[1] for t in times)
    floor = statistics.median(import_torch_seconds() for _ in range(launches))
    note = (
        f"median of {launches} launches; first step at {first:.2f} s, process end (after "
        f"evaluation and checkpoint) {ended:.2f} s; `python -c 'import torch'` {floor:.2f} s; "
        f"ratio = {BUDGET_S:g} s budget / first-step seconds"
    )
    return [
        result("start-up: make train digits", first, BUDGET_S, BUDGET_S / first, 1.0, "s", note)
    ]


def main() -> None:
    for row in run():
        print(f"{row['name']}: {row['measured']:.2f} s (budget {BUDGET_S:g} s); {row['note']}")


if __name__ == "__main__":
    main()
