"""ImageNet recipe on a small folder of real JPEG files, through the real index, decode and
augment pipeline with 2 workers: exact evaluation, bitwise resume with EMA and mixup/cutmix,
and every bad-data case, in real processes."""

import json
import shutil

import pytest

from launch.analysis import report
from tests.datagen_images import (
    SMALL_ARCH,
    plant_not_an_image,
    plant_truncated_jpeg,
    settle,
    wnid,
    write_image_folder,
)
from tests.helpers import final_checkpoint, records, run_dir, run_engine, same_weights
from tests.recipes.cli_calls import engine_calls

pytestmark = pytest.mark.slow
TINY = [
    f"model.arch={SMALL_ARCH}",
    "train.batch_size=6",  # 18 training images: 3 steps cover each exactly once
    "eval.batch_size=4",
    "data.augment.train_size=32",
    "data.augment.eval_resize=36",
    "data.augment.eval_size=32",
    "loader.num_workers=2",
    "log.every_steps=1",
]


def imagenet(root, name, *overrides, variant="", check=True):
    return run_engine(
        root, name, *TINY, *overrides, recipe="imagenet", variant=variant, check=check, timeout=600
    )


@pytest.fixture
def data(tmp_path):
    return write_image_folder(tmp_path / "images")  # apart from the run root, <tmp>/imagenet


def test_trains_through_jpeg_decode_with_workers_and_evaluates_each_image_once(tmp_path, data):
    imagenet(tmp_path, "v1", f"data.root={data}", "train.max_steps=4")
    evaluations = records(tmp_path, "v1", "eval", "imagenet")
    assert [e["count"] for e in evaluations] == [6, 6]  # epoch 1, end; 3 classes x 2 images
    saved = (run_dir(tmp_path, "v1", "imagenet") / "config.yaml").read_text()
    assert "num_classes: 3" in saved  # followed the class folders
    assert final_checkpoint(tmp_path, "v1", "imagenet")["model"]["fc.weight"].shape[0] == 3

    # Where the workers' time went: each record is one batch (log.every_steps=1) from one of
    # the 2 workers, which timed reading, decoding and augmenting its samples and sent the
    # sums with it; all of it fits in the 2 workers' wall time of the windows.
    train = records(tmp_path, "v1", "train", "imagenet")
    assert len(train) == 4
    spent = [[r[f"worker_{s}_s"] for s in ("read", "decode", "augment")] for r in train]
    assert all(seconds > 0 for batch in spent for seconds in batch), spent
    assert sum(map(sum, spent)) <= 2 * sum(r["step_s"] for r in train)
    found = report.read_runs([str(run_dir(tmp_path, "v1", "imagenet"))])
    table = report.markdown(found, None, "top1")
    assert "| run | read | decode | augment |" in table and "\n| v1 | " in table


def test_ema_and_mixup_cutmix_run_resumes_bitwise(tmp_path, data, train_here):
    """The run through and the first half train in the test's process, the second half in a
    process of its own: what the resume needs must come from the checkpoint."""
    common = [f"data.root={data}", "train.max_steps=6", "ema.every_steps=1", "ema.warmup_steps=1"]
    common += ["sched.warmup_epochs=0", "sched.warmup_steps=2"]
    train_here(tmp_path, "whole", *TINY, *common, recipe="imagenet", variant="v2")
    stop = "train.stop_at_step=4"
    train_here(tmp_path, "halves", *TINY, *common, stop, recipe="imagenet", variant="v2")
    imagenet(tmp_path, "halves", *common, variant="v2")
    whole = final_checkpoint(tmp_path, "whole", "imagenet")
    halves = final_checkpoint(tmp_path, "halves", "imagenet")
    assert same_weights(whole["model"], halves["model"])
    assert same_weights(whole["ema"]["model"], halves["ema"]["model"])
    assert int(whole["ema"]["n_averaged"]) == 6  # a copy at step 1, then 5 averaging updates
    assert not same_weights(whole["ema"]["model"], whole["model"])
    assert {"ema_top1", "ema_loss"} <= records(tmp_path, "whole", "eval", "imagenet")[-1].keys()


def bad_layout(data, case):
    if case == "missing root":
        shutil.rmtree(data)
        return
    if case == "missing val":
        shutil.rmtree(data / "val")
    elif case == "empty class":
        for f in (data / "train" / wnid(1)).iterdir():
            f.unlink()
    elif case == "other classes in val":
        (data / "val" / wnid(2)).rename(data / "val" / "n99999999")
    settle(data)


LAYOUT = {
    "missing root": "set data.root",
    "missing val": "val",
    "empty class": wnid(1),
    "other classes in val": "n99999999",
}


def test_a_bad_layout_is_one_line_before_training(tmp_path):
    """Each bad layout's command line in turn, in one process (each stops before training)."""
    folders = {case: write_image_folder(tmp_path / f"images-{i}") for i, case in enumerate(LAYOUT)}
    for case, data in folders.items():
        bad_layout(data, case)
    roots = [tmp_path / f"runs-{i}" for i in range(len(LAYOUT))]
    calls = engine_calls(
        *(
            ["imagenet", *TINY, f"run.root={root}", "run.name=bad", f"data.root={data}"]
            for root, data in zip(roots, folders.values(), strict=True)
        )
    )
    for root, (case, data), out in zip(roots, folders.items(), calls, strict=True):
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (case, out.stderr)
        assert lines[0].startswith("error: ") and str(data) in lines[0] and LAYOUT[case] in lines[0]
        assert not (run_dir(root, "bad", "imagenet") / "checkpoints").exists(), case


@pytest.mark.parametrize("plant", [plant_not_an_image, plant_truncated_jpeg])
def test_an_unreadable_file_stops_training_naming_it(tmp_path, data, plant):
    bad = plant(data / "train" / wnid(0) / f"{wnid(0)}_2.JPEG")
    out = imagenet(tmp_path, "bad", f"data.root={data}", "train.max_steps=3", check=False)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: unreadable sample ") and str(bad) in last
    assert "data.skip_bad=true" in last and "Traceback" not in out.stderr


def test_skip_bad_replaces_counts_and_reports_unreadable_files(tmp_path, data):
    plant_not_an_image(data / "train" / wnid(0) / f"{wnid(0)}_2.JPEG")
    plant_truncated_jpeg(data / "train" / wnid(2) / f"{wnid(2)}_0.JPEG")
    plant_truncated_jpeg(next((data / "val" / wnid(1)).iterdir()))
    out = imagenet(tmp_path, "skip", f"data.root={data}", "train.epochs=2", "data.skip_bad=true")
    summary = json.loads((run_dir(tmp_path, "skip", "imagenet") / "summary.json").read_text())
    assert summary["bad_samples"] == 2 * 2  # two bad files, each met once per epoch
    trained = records(tmp_path, "skip", "train", "imagenet")
    assert trained[-1]["bad_samples"] == 4 and trained[0]["bad_samples"] in (0, 1, 2)
    evaluation = records(tmp_path, "skip", "eval", "imagenet")[-1]
    assert evaluation["count"] == 5 and evaluation["skipped"] == 1
    assert "skipped 4 unreadable training samples" in out.stderr


def test_synthetic_data_needs_no_files(tmp_path):
    imagenet(
        tmp_path,
        "synthetic",
        "data.root=/nonexistent",
        "data.synthetic=true",
        "data.synthetic_train=24",
        "data.synthetic_val=8",
        "data.synthetic_classes=4",
        "train.max_steps=2",
    )
    (evaluation,) = records(tmp_path, "synthetic", "eval", "imagenet")
    assert evaluation["count"] == 8
