"""prof.memory on CUDA: the caching allocator's history written into the run directory at the
end of the run, and on an out-of-memory error, named in the error's one line. Runs where a
GPU is (bench/gpu.sh runs tests/gpu); the CPU's one-line behaviour is tests/engine/
test_profile.py's."""

from __future__ import annotations

import pickle

import pytest
import torch

from engine import train as engine_train
from engine.faults import RunError
from tests.helpers import run_dir

pytestmark = pytest.mark.gpu
ON_CUDA = ["device=cuda", "train.max_steps=3", "train.compile=off", "prof.memory=true"]


def snapshot(path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)  # noqa: S301 - the allocator's own file, written by this test


def test_the_allocators_history_is_written_at_the_end_of_the_run(tmp_path, train_here):
    train_here(tmp_path, "memory", *ON_CUDA, "log.wandb=off")
    path = run_dir(tmp_path, "memory") / "profile" / "rank0-memory.pickle"
    history = snapshot(path)
    assert history["segments"] and any(t for t in history["device_traces"])


def test_an_out_of_memory_error_writes_the_history_and_names_it(tmp_path, train_here, monkeypatch):
    real_step = engine_train.train_step

    def too_big(run, micro):
        if run.progress.step == 1:  # the second step: history recorded for the first
            free, _ = torch.cuda.mem_get_info()
            torch.empty(2 * free, dtype=torch.uint8, device="cuda")  # more than the GPU holds
        return real_step(run, micro)

    monkeypatch.setattr(engine_train, "train_step", too_big)
    with pytest.raises(RunError) as err:
        train_here(tmp_path, "oom", *ON_CUDA, "log.wandb=off")
    path = run_dir(tmp_path, "oom") / "profile" / "rank0-memory.pickle"
    assert str(path) in str(err.value) and "memory_viz" in str(err.value)
    assert snapshot(path)["segments"]
