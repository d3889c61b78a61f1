"""The digits recipe end to end, in real processes: accuracy, reproducibility, resume, W&B."""

import json
import shlex
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import (
    REPO,
    engine_env,
    final_weights,
    read_wandb_history,
    records,
    run_dir,
    run_engine,
    same_weights,
)

pytestmark = pytest.mark.slow
SHORT = ["train.max_steps=40", "ckpt.every_steps=5"]  # 22 steps per epoch: spans two epochs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def reference(root, train_here):
    train_here(root, "reference", *SHORT, "log.sample_ids=true")  # its process is no subject
    return final_weights(root, "reference")


def test_default_recipe_reaches_the_accuracy_bar_logs_to_wandb_offline_and_records_env(tmp_path):
    env = engine_env(
        WANDB_API_KEY="",
        RECIPES_TEST_SECRET="s3cr3t-value",
        RECIPES_TEST_TOKEN="tok-5ecret",
        RECIPES_IMAGE="recipes:test",
    )
    out = run_engine(tmp_path, "full", "log.wandb=offline", env=env)
    summary = json.loads((run_dir(tmp_path, "full") / "summary.json").read_text())
    assert summary["top1"] >= 0.98, summary
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("digits: top1 ") and str(run_dir(tmp_path, "full")) in last

    run_id = (run_dir(tmp_path, "full") / "wandb-id.txt").read_text().strip()
    (log_file,) = run_dir(tmp_path, "full").glob("wandb/offline-run-*/run-*.wandb")
    logged_id, rows = read_wandb_history(log_file)
    assert logged_id == run_id
    logged = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    written = {r["step"]: r["loss"] for r in records(tmp_path, "full", "train")}
    assert logged == pytest.approx(written) and len(written) == 33
    evals = [row for row in rows if "eval/top1" in row]
    assert evals[-1]["eval/top1"] == pytest.approx(summary["top1"])
    assert "wandb sync" in out.stderr  # tells how to upload the offline run

    # env.json: provenance, and no secret from the environment in any file the run wrote
    info = json.loads((run_dir(tmp_path, "full") / "env.json").read_text())
    assert info["torch"].startswith("2.14.1") and info["world_size"] == 1
    assert len(info["git_sha"]) == 40 and isinstance(info["git_dirty"], bool)
    assert info["image"]["image"] == "recipes:test" and len(info["lock_sha256"]) == 64
    for path in run_dir(tmp_path, "full").rglob("*"):
        if path.is_file():
            assert b"tok-5ecret" not in path.read_bytes(), path


def test_same_seed_gives_identical_losses_and_weights(root, reference):
    run_engine(root, "again", *SHORT)
    assert same_weights(final_weights(root, "again"), reference)
    assert records(root, "again", "train") != []
    losses = lambda name: [r["loss"] for r in records(root, name, "train")]  # noqa: E731
    assert losses("again") == losses("reference")


def test_different_seed_gives_different_weights(root, reference):
    run_engine(root, "seed1", *SHORT, "seed=1")
    assert not same_weights(final_weights(root, "seed1"), reference)


def test_stop_mid_epoch_and_resume_is_bitwise_identical(root, reference):
    first = run_engine(root, "stopped", *SHORT, "train.stop_at_step=17")
    assert "stopped at step 17" in first.stderr
    assert not (run_dir(root, "stopped") / "summary.json").exists()
    second = run_engine(root, "stopped", *SHORT)
    assert "resuming from" in second.stderr and "step 17" in second.stderr
    assert same_weights(final_weights(root, "stopped"), reference)
    steps = [r["step"] for r in records(root, "stopped", "train")]
    assert steps == sorted(set(steps))  # no record repeated by the resumed process


def test_num_workers_change_neither_order_nor_result(root, reference):
    # The reference loads in this process (loader.num_workers=0, the recipe's default).
    run_engine(root, "w2", *SHORT, "log.sample_ids=true", "loader.num_workers=2")
    order = lambda n: (run_dir(root, n) / "samples.jsonl").read_text()  # noqa: E731
    assert order("reference") == order("w2") and len(order("w2").splitlines()) == 40
    assert same_weights(final_weights(root, "w2"), reference)  # augmentation seeded per sample


def test_resumed_run_continues_the_same_wandb_run(tmp_path):
    run_engine(tmp_path, "wb", "train.max_steps=12", "train.stop_at_step=6", "log.wandb=offline")
    first_id = (run_dir(tmp_path, "wb") / "wandb-id.txt").read_text()
    run_engine(tmp_path, "wb", "train.max_steps=12", "log.wandb=offline")
    assert (run_dir(tmp_path, "wb") / "wandb-id.txt").read_text() == first_id
    logs = sorted(run_dir(tmp_path, "wb").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and {read_wandb_history(p)[0] for p in logs} == {first_id.strip()}


def test_progress_bar_on_a_terminal_and_plain_lines_otherwise(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "engine.train",
        "digits",
        "log.wandb=off",
        "device=cpu",
        f"run.root={tmp_path}",
        "train.max_steps=12",
        "log.every_steps=5",
    ]
    plain = subprocess.run(
        cmd + ["run.name=plain"],
        cwd=REPO,
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "step 10/12 epoch 1 loss" in plain.stderr and "step/s" not in plain.stderr
    # `script` gives the process a real terminal (a pty) of 100 columns
    inner = "stty cols 100 rows 30; " + shlex.join(cmd + ["run.name=tty"])
    tty = subprocess.run(
        ["script", "-qec", inner, "/dev/null"],
        cwd=REPO,
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tty.returncode == 0, tty.stdout
    assert "12/12 [" in tty.stdout and "step/s" in tty.stdout
    assert "step 10/12 epoch" not in tty.stdout


def test_the_direct_table_read_equals_scikit_learns_loader():
    from sklearn.datasets import load_digits

    from recipes.digits.data import digits_table

    images, labels = digits_table()
    reference = load_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
