"""Data order: a function of (seed, epoch) alone, cut into global batches shared by ranks.

Global batch k of an epoch is perm[k*B:(k+1)*B] of that epoch's permutation. Rank r takes the
contiguous r-th 1/W of it, in micro batches of m samples: accumulation steps A = B/(m*W).
The position in an epoch is a count of global samples, so a checkpoint taken on W processes
resumes on any W' that divides the global batch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
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


def check_elastic(global_batch: int, micro_batch: int | None, world_sizes: list[int]) -> None:
    """An elastic run may take any of these world sizes and must keep its global batch at
    each: the batch divides over every one of them (over their least common multiple), and
    a fixed micro batch, so that a shrink adds accumulation steps rather than memory,
    divides every per-process share (it divides global_batch / lcm)."""
    if len(world_sizes) < 2:
        plan_batches(global_batch, micro_batch, world_sizes[0])
        return
    sizes = ", ".join(map(str, world_sizes))
    lcm = math.lcm(*world_sizes)
    # With a micro batch given, every per-process share must hold whole micro batches: the
    # global batch is then a multiple of lcm x micro batch, and the advice says so at once.
    step = lcm * (micro_batch or 1)
    if global_batch % lcm:
        bad = next(w for w in world_sizes if global_batch % w)
        raise ConfigError(
            f"train.batch_size={global_batch} does not divide over {bad} processes, one of "
            f"this elastic run's world sizes ({sizes}); use a multiple of {step}"
            f"{_of_micro(micro_batch)}, e.g. train.batch_size={_near(global_batch, step)}"
        )
    share = global_batch // lcm  # what every world size's per-process batch is a multiple of
    if micro_batch is None:
        raise ConfigError(
            f"an elastic run (world sizes {sizes}) needs a fixed train.micro_batch_size, so "
            f"that losing a node adds accumulation steps, not memory; set "
            f"train.micro_batch_size={share} (or a divisor of it)"
        )
    if share % micro_batch:
        fits = max(d for d in range(1, min(micro_batch, share) + 1) if share % d == 0)
        raise ConfigError(
            f"train.micro_batch_size={micro_batch} does not divide the per-process batch of "
            f"every world size of this elastic run ({sizes}; train.batch_size={global_batch}); "
            f"use train.micro_batch_size={fits} (a divisor of {share}), or keep it and set "
            f"train.batch_size={_near(global_batch, step)}"
        )


def _of_micro(micro_batch: int | None) -> str:
    if not micro_batch:
        return ""
    return f" (their least common multiple times the micro batch, {micro_batch})"


def _near(value: int, step: int) -> str:
    """The multiples of step nearest value: "192 or 288", or the first one when value < step."""
    lower, upper = value // step * step, (value // step + 1) * step
    return f"{lower} or {upper}" if lower else str(upper)


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(derive_seed(seed, epoch, 0x5A3B1E))
    return torch.randperm(n, generator=gen)


class Keys(Sequence):
    """One micro batch's keys, (dataset index, sample seed, epoch) each, held per batch: the
    indices as a CPU int64 tensor (a slice of the epoch's permutation), the epoch, and the
    epoch's seed base (sample i's seed is (base + i) mod 2**63). A sequence of those tuples
    for whoever reads them one by one; a loader that works on whole batches reads `index`
    and never builds a tuple per sample. The epoch travels with the keys so that
    epoch-dependent loading (progressive resizing) works in persistent workers, which never
    see the sampler."""

    __slots__ = ("index", "epoch", "base")

    def __init__(self, index: torch.Tensor, epoch: int, base: int):
        self.index, self.epoch, self.base = index, epoch, base

    def __len__(self) -> int:
        return len(self.index)

    def seeds(self) -> list[int]:
        base = self.base
        return [(base + i) % 2**63 for i in self.index.tolist()]

    def __getitem__(self, k):
        if isinstance(k, slice):
            return list(self)[k]
        i = int(self.index[k])
        return (i, (self.base + i) % 2**63, self.epoch)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(self.index.tolist(), self.seeds(), itertools.repeat(self.epoch))

    def __repr__(self) -> str:
        return f"Keys({self.index.tolist()}, epoch={self.epoch}, base={self.base})"

    def __reduce__(self):  # to a worker as a list: no shared-memory tensor per batch
        return (_keys, (self.index.tolist(), self.epoch, self.base))


def _keys(index: list[int], epoch: int, base: int) -> Keys:
    return Keys(torch.tensor(index, dtype=torch.long), epoch, base)


def check_batch_fits(samples: int, batch_size: int) -> None:
    """A global batch needs that many training samples (one optimizer step draws them)."""
    if samples < batch_size:
        raise ConfigError(
            f"the training set has {samples} samples, fewer than train.batch_size={batch_size}: "
            "lower train.batch_size, or train on more data"
        )


class GlobalBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro batches as Keys: (dataset index, sample seed, epoch) each."""

    def __init__(self, n: int, plan: BatchPlan, rank: int, seed: int):
        check_batch_fits(n, plan.global_batch)
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

    def __iter__(self) -> Iterator[Keys]:
        perm = epoch_permutation(self.seed, self.epoch, self.n)
        base = derive_seed(self.seed, self.epoch)  # sample i's seed: base + i
        plan, b = self.plan, self.plan.global_batch
        for first in range(self.start, self.steps_per_epoch * b, b):
            mine = first + self.rank * plan.per_rank
            for j in range(plan.accum_steps):
                lo = mine + j * plan.micro_batch
                yield Keys(perm[lo : lo + plan.micro_batch], self.epoch, base)


class Sample(NamedTuple):
    """One loaded sample for a key, or a batch of them (each field collated: index and
    replaced as int64 tensors). `replaced` is 1 where an unreadable file was replaced
    (data.skip_bad)."""

    x: Any
    y: Any
    index: int
    replaced: int
    # a training batch a loader worker loaded: its seconds in read, decode and augment
    # (engine.data.stages.WORKER_STAGES); None where this process loaded it
    work: Any = None


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
