"""Loaders around a recipe's datasets. Recipes return datasets; the engine owns order,
sharding, workers and seeding."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from engine.config import LoaderConfig
from engine.data.sampler import GlobalBatchSampler, eval_shard
from engine.seeding import derive_seed, seed_sample, worker_init


class SeededSamples(Dataset):
    """Takes (index, sample seed) keys; returns (input, target, index).

    Seeding per sample makes augmentation independent of which worker loads it. In the main
    process (num_workers=0) torch's RNG state is restored afterwards, so model-side randomness
    (dropout) is the same whatever the number of workers. With seed_python_numpy, python's and
    numpy's global RNGs are seeded per sample too and left so: the loop does not draw from
    them, and restoring numpy's state would cost more than loading the sample."""

    def __init__(self, dataset: Dataset, python_numpy: bool = False):
        self.dataset = dataset
        self.python_numpy = python_numpy

    def __len__(self) -> int:
        return len(self.dataset)

    def _load(self, key: tuple[int, int]):
        index, sample_seed = key
        seed_sample(sample_seed, self.python_numpy)
        return (*self.dataset[index], index)

    def __getitem__(self, key: tuple[int, int]):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        """A whole micro batch at once (the DataLoader calls this when it exists), so the
        caller's RNG state is saved and restored once per batch, not once per sample."""
        if torch.utils.data.get_worker_info() is not None:
            return [self._load(key) for key in keys]
        saved = torch.default_generator.get_state()
        try:
            return [self._load(key) for key in keys]
        finally:
            torch.default_generator.set_state(saved)


def _worker_options(cfg: LoaderConfig, device: torch.device) -> dict:
    opts = {"num_workers": cfg.num_workers, "pin_memory": cfg.pin_memory and device.type == "cuda"}
    if cfg.num_workers > 0:
        opts |= {
            "persistent_workers": cfg.persistent_workers,
            "prefetch_factor": cfg.prefetch_factor,
            "worker_init_fn": worker_init,
        }
    return opts


def train_loader(
    dataset: Dataset, sampler: GlobalBatchSampler, cfg: LoaderConfig, device: torch.device
) -> DataLoader:
    generator = torch.Generator().manual_seed(derive_seed(sampler.seed, sampler.rank, 0x10AD))
    return DataLoader(
        SeededSamples(dataset, cfg.seed_python_numpy),
        batch_sampler=sampler,
        generator=generator,
        **_worker_options(cfg, device),
    )


def eval_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    cfg: LoaderConfig,
    device: torch.device,
) -> DataLoader:
    shard = Subset(dataset, eval_shard(len(dataset), rank, world_size))
    opts = _worker_options(cfg, device) | {"persistent_workers": False}
    if cfg.num_workers == 0:
        opts.pop("persistent_workers")
    return DataLoader(shard, batch_size=batch_size, shuffle=False, drop_last=False, **opts)
