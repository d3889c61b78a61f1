"""Load: two processes checkpointing every few steps for a long run. Files, open descriptors
and memory must stay bounded: a leak that costs nothing in a 10-step test ends a 3-day run."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import QUIET, REPO, engine_env, records, run_dir

pytestmark = [pytest.mark.slow, pytest.mark.dist]
KEEP = 2
STEPS = 132  # 6 epochs of 22 steps: 44 checkpoints, 6 evaluations and loader restarts
SOAK = [
    f"train.max_steps={STEPS}",
    "ckpt.every_steps=3",
    f"ckpt.keep={KEEP}",
    "log.every_steps=5",
    "loader.num_workers=1",  # persistent worker processes, and a fresh set per evaluation
]


def ranks(pid: int) -> list[int]:
    """The training processes --spawn started: the children of its fork server (not
    multiprocessing's resource tracker, not the fork server itself)."""
    servers = [p for p in children(pid) if b"forkserver" in cmdline(p)]
    return [p for server in servers for p in children(server)]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text() if (task / "children").exists() else ""
        found += [int(p) for p in text.split()]
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""  # gone


def usage(pid: int) -> tuple[int, int] | None:
    """(open descriptors, resident KiB) of a live process; None once it is gone."""
    try:
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rss = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")]
    return (fds, rss[0]) if rss else None  # a zombie has no resident set


def middle_and_last_thirds(series: list[tuple[int, int, int]]) -> tuple[list, list]:
    """The samples taken in the middle and the last third of the run's steps. The first
    third is start-up and warm-up (imports, allocator pools, the first evaluation): a run
    grows there by design. A leak shows as growth after it. Thirds of the steps, not of the
    samples: on a loaded machine the start-up can take a third of the time by itself.
    Samples taken once the last checkpoint is written are left out: the run's end (final
    evaluation, summary, teardown) is not a step that repeats, and a loaded machine once
    caught a process 90 MiB larger there."""
    early = [(f, r) for step, f, r in series if STEPS / 3 <= step < 2 * STEPS / 3]
    late = [(f, r) for step, f, r in series if 2 * STEPS / 3 <= step < STEPS]
    return early, late


def newest_step(folder: Path) -> int:
    """The step of the newest checkpoint in the folder (0: none yet)."""
    names = [p.name for p in folder.iterdir() if p.name.startswith("step-")]
    return max((int(n.split("-")[1].split(".")[0]) for n in names), default=0)


def test_a_long_two_process_run_keeps_files_descriptors_and_memory_bounded(tmp_path):
    args = [sys.executable, "-m", "engine.train", "--spawn", "2", "digits", *QUIET]
    args += [f"run.root={tmp_path}", "run.name=soak", *SOAK]
    proc = subprocess.Popen(
        args, cwd=REPO, env=engine_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    folder = run_dir(tmp_path, "soak") / "checkpoints"
    samples: dict[int, list[tuple[int, int, int]]] = {}  # rank pid -> (step, fds, rss)
    most_files = step = 0
    deadline = time.monotonic() + 900
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the soak run did not finish"
        if folder.is_dir():
            most_files = max(most_files, sum(1 for p in folder.iterdir()))
            step = newest_step(folder)
        for pid in ranks(proc.pid):
            if (seen := usage(pid)) is not None:
                samples.setdefault(pid, []).append((step, *seen))
        time.sleep(0.2)
    assert proc.returncode == 0, proc.stderr.read().decode()[-3000:]

    steps = [r["step"] for r in records(tmp_path, "soak", "train")]
    assert steps == list(range(5, STEPS + 1, 5))
    assert most_files <= KEEP + 1  # kept checkpoints and at most one being written
    assert len(list(folder.iterdir())) == KEEP
    # both ranks sampled in the middle and the last third of the steps, however fast the run
    # (a count of samples, >= 30, failed where the whole run took less than 15 s)
    long_lived = [s for s in samples.values() if min(map(len, middle_and_last_thirds(s))) >= 5]
    assert len(long_lived) == 2, f"sampled {[len(s) for s in samples.values()]} times"
    for series in long_lived:
        early, late = middle_and_last_thirds(series)
        assert max(f for f, _ in late) <= max(f for f, _ in early) + 4, "descriptors leak"
        grown_mib = (max(r for _, r in late) - max(r for _, r in early)) / 1024
        assert grown_mib < 64, f"resident memory grew by {grown_mib:.0f} MiB"
    summary = json.loads((run_dir(tmp_path, "soak") / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
