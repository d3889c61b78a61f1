"""The data a run reads: the datasets, the global sampler, the loader built once (so
persistent workers persist) and the batch mixing. Nothing here is saved: the sampler's
order is a function of the seed, the epoch and the position (engine.parts.progress)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.data.mix import BatchMix
from engine.data.sampler import GlobalBatchSampler
from engine.parts import Part, transient


@dataclass
class Feed(Part):
    sampler: GlobalBatchSampler = transient()
    loader: torch.utils.data.DataLoader = transient()
    train_data: torch.utils.data.Dataset = transient()
    eval_data: torch.utils.data.Dataset = transient()
    mix: BatchMix | None = transient(default=None)  # mixup/cutmix: a function of the position

    def epoch_samples(self) -> int:
        """Global samples per epoch: an epoch ends when the position reaches it."""
        return self.sampler.steps_per_epoch * self.sampler.plan.global_batch
