"""A run names the data it trained on (env.json, summary.json, every checkpoint), and a
resume over other data (one JPEG added to a class folder) stops in one line naming the
change, exit 2, unless run.allow_data_change says so, when the change is recorded."""

from __future__ import annotations

import json
import shutil

import pytest

from launch.analysis import report
from tests.datagen_images import SMALL_ARCH, settle, write_image_folder
from tests.helpers import final_checkpoint, records, run_dir, run_engine

pytestmark = pytest.mark.slow  # trains the imagenet recipe on its example data
TINY = [
    f"model.arch={SMALL_ARCH}",
    "train.batch_size=6",
    "eval.batch_size=4",
    "data.augment.train_size=32",
    "data.augment.eval_resize=36",
    "data.augment.eval_size=32",
    "loader.num_workers=0",
    "train.max_steps=4",
    "log.every_steps=1",
]


def test_a_resume_over_a_train_folder_with_one_more_jpeg_stops_in_one_line(tmp_path, train_here):
    images = write_image_folder(tmp_path / "images")
    common = [*TINY, f"data.root={images}"]
    train_here(tmp_path, "r", *common, "train.stop_at_step=2", recipe="imagenet")
    run = run_dir(tmp_path, "r", "imagenet")
    env = json.loads((run / "env.json").read_text())
    assert env["data"]["train"]["count"] == 18 and env["data"]["eval"]["count"] == 6
    assert env["data"]["train"]["summary"].startswith("18 files in 3 classes")
    assert final_checkpoint(tmp_path, "r", "imagenet")["data"]["train"]["count"] == 18

    shutil.copy(images / "train/n00000000/n00000000_0.JPEG", images / "train/n00000000/z.JPEG")
    settle(images)
    before = (run / "metrics.jsonl").read_text()
    refused = run_engine(tmp_path, "r", *common, recipe="imagenet", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert "train data 18 -> 19 files (n00000000/z.JPEG added)" in line, line
    assert "run.allow_data_change=true" in line and "eval data" not in line
    assert (run / "metrics.jsonl").read_text() == before

    train_here(tmp_path, "r", *common, "run.allow_data_change=true", recipe="imagenet")
    (change,) = records(tmp_path, "r", "data", "imagenet")
    assert change["step"] == 2 and change["change"].startswith("train data 18 -> 19 files")
    assert (change["from"]["train"]["count"], change["to"]["train"]["count"]) == (18, 19)
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["data"]["train"]["count"]
        == 19
        == json.loads((run / "env.json").read_text())["data"]["train"]["count"]
    )
    assert final_checkpoint(tmp_path, "r", "imagenet")["data"]["train"]["count"] == 19
    text = report.markdown(report.read_runs([str(run)]), None, "top1")
    assert "## Changes of data" in text and "| r | 2 | train data 18 -> 19 files" in text, text
    assert "## Changes of code" not in text
