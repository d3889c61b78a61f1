"""Records of what happened to a run (a change of world size), beside its metrics: in
metrics.jsonl, and in W&B even where W&B has passed the step they name (a resumed W&B run
drops what is logged at a step it has passed)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, engine_env, read_wandb_history

pytestmark = pytest.mark.slow

WRITE = """
import sys
from pathlib import Path
from engine.config import LogConfig
from engine.tracking import Tracker
run = Path(sys.argv[1])
run.mkdir()
tracker = Tracker(run, LogConfig(), "offline", {}, 0)
for step in (1, 2, 3):
    tracker.write({"kind": "train", "step": step, "loss": 1.0 / step})
tracker.write({"kind": "world_size", "step": 2, "from": 2, "to": 1, "redone_steps": 1})
tracker.close()
"""


def test_a_world_size_record_reaches_w_and_b_after_later_steps(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in engine_env().items() if not k.startswith("WANDB_")}
    done = subprocess.run(
        [sys.executable, "-c", WRITE, str(run)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    kinds = [json.loads(line)["kind"] for line in (run / "metrics.jsonl").open()]
    assert kinds == ["train", "train", "train", "world_size"]
    (log_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    _, rows = read_wandb_history(log_file)
    (event,) = [row for row in rows if "world_size/to" in row]
    assert (event["world_size/step"], event["world_size/from"], event["world_size/to"]) == (2, 2, 1)
    assert event["_step"] >= 3  # W&B's own step, past the train records'
    assert [row["train/loss"] for row in rows if "train/loss" in row] == [1.0, 0.5, 1.0 / 3]
