"""A run that finishes exits 0, on every path: its process group, with gloo's threads, is
destroyed inside the engine, never during interpreter shutdown, where it sometimes aborted a
finished process (SIGABRT, "terminate called without an active exception"): SLURM then marks
the job FAILED and may requeue it. The cause was torch.distributed.nn.functional, imported by
DDP's constructor after the group existed, holding the group as a default argument
(engine/distributed.py imports it first). tests/distributed/repeat_exit.py repeats the
shortest 2-process run many times and counts aborts."""

import re
import subprocess
import sys

import pytest

from tests.helpers import QUIET, REPO, engine_env

pytestmark = [pytest.mark.dist, pytest.mark.slow]
SCRIPT = REPO / "tests" / "distributed" / "gloo_threads.py"


def threads_left(root, name, *head):
    report = root / f"threads-{name}-{len(head)}"
    report.mkdir()
    args = [*QUIET, f"run.root={root}", "train.max_steps=2", "model.norm=group"]
    cmd = [sys.executable, str(SCRIPT), name, "digits", *head, "--", *args]
    out = subprocess.run(
        cmd,
        cwd=REPO,
        env={**engine_env(), "GLOO_THREADS_OUT": str(report)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = "".join(f.read_text() for f in sorted(report.iterdir()))
    return re.findall(r"rank (\d) exit 0 gloo threads left: (.*)", lines)


def test_gloo_threads_end_inside_the_engine_after_training_and_after_evaluation(tmp_path):
    # Training wraps the model in DDP; evaluation builds the same run without training.
    trained = threads_left(tmp_path, "ddp")
    scored = threads_left(tmp_path, "ddp", "--eval", str(tmp_path / "digits" / "ddp"))
    assert sorted(trained) == sorted(scored) == [("0", "[]"), ("1", "[]")]
