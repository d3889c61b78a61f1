"""The loaders' shared memory is estimated before the workers start: a batch sized from one
real sample, times workers, prefetch and the node's processes, set against /dev/shm's free
space; above it, one warning with the fixes."""

from __future__ import annotations

import pytest
import torch

from engine import distributed as D
from engine.assemble import setup
from engine.catalog import load_config
from engine.config import LoaderConfig
from engine.data import shm
from engine.data.loaders import SeededSamples
from tests.datagen_images import SMALL_ARCH, write_image_folder

GIB = 2**30


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("shm") / "imagenet", classes=2)


def imagenet_run(folder, tmp_path, *overrides):
    cfg, recipe = load_config(
        "imagenet",
        [
            "log.wandb=off",
            "log.progress=off",
            "device=cpu",
            f"run.root={tmp_path}",
            f"data.root={folder}",
            f"model.arch={SMALL_ARCH}",
            "train.batch_size=4",
            "eval.batch_size=4",
            *overrides,
        ],
    )
    run = setup(cfg, recipe, D.DistEnv(), torch.device("cpu"), records=False)
    run.records.tracker.close()
    return run


def test_a_sample_is_sized_as_the_workers_send_it(folder, tmp_path):
    run = imagenet_run(folder, tmp_path, "data.augment.train_size=64")
    assert shm.sample_bytes(SeededSamples(run.feed.train_data)) == 3 * 64 * 64  # uint8 CHW
    # evaluation's crop, not training's
    assert shm.sample_bytes(SeededSamples(run.feed.eval_data)) == 3 * 224 * 224


def test_loading_the_sample_leaves_the_rng_as_it_was(folder, tmp_path):
    run = imagenet_run(folder, tmp_path)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert shm.sample_bytes(SeededSamples(run.feed.train_data))
    assert torch.equal(torch.rand(4), expected)


def test_the_estimate_multiplies_out_and_warns_above_what_is_free(folder, tmp_path, monkeypatch):
    run = imagenet_run(folder, tmp_path, "data.augment.train_size=64")
    samples, cfg = (
        SeededSamples(run.feed.train_data),
        LoaderConfig(num_workers=8, prefetch_factor=4),
    )
    need = 8 * 8 * 4 * 32 * 3 * 64 * 64  # processes, workers, prefetch, batch, bytes
    monkeypatch.setattr(shm, "free_bytes", lambda: need)
    assert shm.check(samples, 32, cfg, processes=8) is None  # it just fits
    monkeypatch.setattr(shm, "free_bytes", lambda: need - 1)
    text = shm.check(samples, 32, cfg, processes=8)
    assert text.startswith("warning: ") and "\n" not in text
    for fix in ("--ipc=host", "--shm-size=", "loader.num_workers", "loader.prefetch_factor"):
        assert fix in text
    assert "8 process(es) x 8 workers x 4 prefetched x 32 samples" in text
    # no workers: nothing waits in shared memory
    assert shm.check(samples, 32, LoaderConfig(num_workers=0), processes=8) is None


def test_set_up_says_it_once_before_training(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shm, "free_bytes", lambda: 2**20)  # a nearly full /dev/shm
    imagenet_run(folder, tmp_path, "loader.num_workers=2")
    said = [line for line in capsys.readouterr().err.splitlines() if "/dev/shm" in line]
    assert len(said) == 1 and said[0].startswith("warning: the loader workers may hold")
    monkeypatch.setattr(shm, "free_bytes", lambda: 64 * GIB)
    imagenet_run(folder, tmp_path, "loader.num_workers=2", "run.name=second")
    assert "/dev/shm" not in capsys.readouterr().err


def test_processes_per_node_come_from_the_launcher():
    assert shm.processes_on_node({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert shm.processes_on_node({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}) == 4
    assert shm.processes_on_node({"SLURM_NTASKS_PER_NODE": "2"}) == 2
    assert shm.processes_on_node({}) == 1
