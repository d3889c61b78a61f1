"""A rank that hangs (the fault injection's planted hang) ends a real 2-process gloo run in
one line naming it and its step, with every rank's Python stack in the run directory, long
before the collective's timeout; a one-process run that keeps making progress is left alone."""

import json
import re
import sys

import pytest

from tests import helpers
from tests.helpers import run_dir, run_engine

pytestmark = [pytest.mark.dist, pytest.mark.slow]
HANG_S = 3


def test_a_hung_rank_is_named_with_its_step_and_every_ranks_stack_is_in_the_run(tmp_path):
    spawn = [sys.executable, "-m", "engine.train", "--spawn", "2"]
    # dist.timeout_s stays 600 s: only the watchdog can end this run within the subprocess's
    # timeout (a silent hang would exceed it and fail the test).
    out = run_engine(
        tmp_path,
        "hung",
        "train.max_steps=20",
        "fault.hang_at_step=3",
        "fault.rank=1",
        f"dist.hang_s={HANG_S}",
        prefix=spawn,
        check=False,
        timeout=150,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    folder = run_dir(tmp_path, "hung") / "hang"
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: hang: rank 1 stopped after step 3 and did not reach step 4, where rank 0 waits "
        f"(no progress for {HANG_S}s, dist.hang_s); every rank's Python stack is in {folder}/, "
        "rank 1's in rank1.txt"
    ), out.stderr[-3000:]
    hung, waiting = (folder / "rank1.txt").read_text(), (folder / "rank0.txt").read_text()
    assert "inject_after_step" in hung and "engine/faults.py" in hung  # the planted sleep
    assert "train_step" in waiting  # rank 0 waits in step 4's gradient reduction
    idle = int(re.search(r"no progress for (\d+)s", hung.splitlines()[0])[1])
    assert HANG_S <= idle < HANG_S + 30  # its own deadline, not the collective's timeout
    state = json.loads((run_dir(tmp_path, "hung") / "state.json").read_text())
    assert state["state"] == "failed" and state["why"] == last.removeprefix("error: ")
    assert last in (run_dir(tmp_path, "hung") / "train.log").read_text()


def test_a_slow_run_that_makes_progress_never_trips_the_watchdog(tmp_path):
    # 12 steps of 0.4 s each (4.8 s), an evaluation and a checkpoint: longer than hang_s in
    # all, each step shorter.
    out = run_engine(
        tmp_path,
        "slow",
        "train.max_steps=12",
        "fault.data_delay_ms=400",
        "dist.hang_s=2",
        timeout=150,
    )
    assert "hang" not in out.stderr
    assert not (run_dir(tmp_path, "slow") / "hang").exists()


def test_a_hung_worker_under_make_train_ends_in_its_line_and_one_of_torchrun_s(tmp_path):
    """PROCS=2: launch's torchrun. The hang's one line is followed by one line of torchrun's
    naming the first rank that failed, with its exit code, not ChildFailedError's traceback."""
    args = f"train.max_steps=20 fault.hang_at_step=3 fault.rank=1 dist.hang_s={HANG_S}"
    done = helpers.launch("train", GPUS="0", PROCS="2", timeout=150,
                          ARGS=f"{args} run.root={tmp_path} log.wandb=off")  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert re.fullmatch(r"torchrun: worker rank \d \(pid \d+\) exited with code 1 first; its "
                        r"own lines above say why", lines[-1]), lines[-1]  # fmt: skip
    assert any(line.startswith("error: hang: rank 1 stopped after step 3") for line in lines)
