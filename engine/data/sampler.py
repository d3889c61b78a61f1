"""Data order: a function of (seed, epoch) alone, cut into global batches shared by ranks.

Global batch k of an epoch is perm[k*B:(k+1)*B] of that epoch's permutation. Rank r takes the
contiguous r-th 1/W of it, in micro batches of m samples: accumulation steps A = B/(m*W).
The position in an epoch is a count of global samples, so a checkpoint taken on W processes
resumes on any W' that divides the global batch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from engine.config import ConfigError
from engine.seeding import derive_seed


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    micro_batch: int
    world_size: int

    @property
    def accum_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.world_size)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size


def plan_batches(global_batch: int, micro_batch: int | None, world_size: int) -> BatchPlan:
    if global_batch % world_size:
        raise ConfigError(
            f"train.batch_size={global_batch} does not divide over {world_size} processes; "
            f"use a multiple of {world_size}"
        )
    per_rank = global_batch // world_size
    micro = micro_batch or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"train.batch_size={global_batch} over {world_size} processes is {per_rank} per "
            f"process, not a multiple of train.micro_batch_size={micro}"
        )
    return BatchPlan(global_batch, micro, world_size)


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(derive_seed(seed, epoch, 0x5A3B1E))
    return torch.randperm(n, generator=gen)


class GlobalBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro batches as lists of (dataset index, sample seed, epoch) keys.
    The epoch travels with each key so that epoch-dependent loading (progressive resizing)
    works in persistent workers, which never see the sampler."""

    def __init__(self, n: int, plan: BatchPlan, rank: int, seed: int):
        if n < plan.global_batch:
            raise ConfigError(
                f"the training set has {n} samples, fewer than train.batch_size={plan.global_batch}"
            )
        self.n, self.plan, self.rank, self.seed = n, plan, rank, seed
        self.epoch, self.start = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.plan.global_batch  # the incomplete last batch is dropped

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        if start_sample % self.plan.global_batch:
            raise ValueError(f"position {start_sample} is not on a global batch boundary")
        self.epoch, self.start = epoch, start_sample

    def __len__(self) -> int:
        remaining = self.steps_per_epoch - self.start // self.plan.global_batch
        return remaining * self.plan.accum_steps

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        perm = epoch_permutation(self.seed, self.epoch, self.n).tolist()
        base = derive_seed(self.seed, self.epoch)  # sample i's seed: base + i
        plan, b = self.plan, self.plan.global_batch
        for first in range(self.start, self.steps_per_epoch * b, b):
            mine = first + self.rank * plan.per_rank
            for j in range(plan.accum_steps):
                lo = mine + j * plan.micro_batch
                yield [
                    (i, (base + i) % 2**63, self.epoch) for i in perm[lo : lo + plan.micro_batch]
                ]


class Sample(NamedTuple):
    """One loaded sample for a key; the default collate turns a list of them into a batch of
    the same shape. `replaced` is 1 where an unreadable file was replaced (data.skip_bad)."""

    x: Any
    y: Any
    index: int
    replaced: int


def eval_batches(shard: range, batch_size: int) -> list[list[tuple[int, int, int]]]:
    """A shard in order, as keys (index, 0, 0): evaluation is deterministic, unseeded."""
    return [
        [(i, 0, 0) for i in shard[k : k + batch_size]] for k in range(0, len(shard), batch_size)
    ]


def eval_shard(n: int, rank: int, world_size: int) -> range:
    """Contiguous, disjoint shards covering 0..n-1 exactly once: no padding, no duplicates."""
    lo = n * rank // world_size
    hi = n * (rank + 1) // world_size
    return range(lo, hi)
