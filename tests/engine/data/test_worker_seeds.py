"""Randomness in the training loader's workers (engine.data.loaders, engine.seeding), with a
real DataLoader of two worker processes. Each sample's augmentation draws come from its own
sample seed, whichever worker loads it: torch's always, python's and numpy's too with
loader.seed_python_numpy, so each sample draws what its seed alone gives and no two samples
draw alike. Randomness outside that (python and numpy without seed_python_numpy) comes from
worker_init's per-worker seed: the two workers never repeat each other's draws."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from engine.config import LoaderConfig
from engine.data.loaders import train_loader
from engine.data.sampler import GlobalBatchSampler, plan_batches

N = 32
CPU = torch.device("cpu")


class Draws(Dataset):
    """Samples that are an augmentation's random draws (torch, python, numpy), labelled with
    the worker that loaded them."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        draws = [torch.rand(()).item(), random.random(), np.random.rand()]
        info = get_worker_info()
        return torch.tensor(draws, dtype=torch.float64), info.id if info else -1


def loaded(python_numpy: bool, workers: int = 2) -> list[tuple[int, list[float], int]]:
    """(sample seed, its draws, the worker) for each sample of one epoch."""
    sampler = GlobalBatchSampler(N, plan_batches(4, 4, 1), rank=0, seed=7)
    sampler.set_epoch(1)
    seeds = {index: seed for keys in sampler for index, seed, _ in keys}
    cfg = LoaderConfig(
        num_workers=workers, persistent_workers=False, seed_python_numpy=python_numpy
    )
    return [
        (seeds[int(i)], x.tolist(), int(w))
        for batch in train_loader(Draws(), sampler, cfg, CPU)
        for i, x, w in zip(batch.index, batch.x, batch.y, strict=True)
    ]


def first_draws(seed: int) -> list[float]:
    """What torch's, python's and numpy's generators draw first from this seed."""
    return [
        torch.rand((), generator=torch.Generator().manual_seed(seed)).item(),
        random.Random(seed).random(),
        np.random.RandomState(seed % 2**32).rand(),
    ]


@pytest.mark.parametrize("python_numpy", [True, False])
def test_each_sample_draws_from_its_own_seed_in_either_worker(python_numpy):
    samples = loaded(python_numpy)
    assert len(samples) == N and {w for _, _, w in samples} == {0, 1}
    assert len({seed for seed, _, _ in samples}) == N  # no sample seed repeats
    seeded = 3 if python_numpy else 1  # torch's draws always; python's and numpy's if asked
    for seed, draws, _ in samples:
        assert draws[:seeded] == first_draws(seed)[:seeded]
    assert len({tuple(draws[:seeded]) for _, draws, _ in samples}) == N


def test_draws_outside_the_sample_seed_differ_between_workers():
    samples = loaded(python_numpy=False)
    for column in (1, 2):  # python's, numpy's
        by_worker = [{d[column] for _, d, w in samples if w == worker} for worker in (0, 1)]
        assert by_worker[0] and by_worker[1]
        shared = by_worker[0] & by_worker[1]
        assert not shared, f"both workers drew {len(shared)} of the same values (column {column})"
