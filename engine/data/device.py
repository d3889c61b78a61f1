"""Data resident on the training device, batched there (the airbench way): no workers, no
host-to-device copies in the loop. DeviceData is what the loaders and the set-up know of it;
engine.vision.device.DeviceImages (uint8 images, flipped and translated per sample) is the
one kind so far, beside the generic core as every image module is."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.data import Dataset

from engine.data.sampler import Keys, Sample


class DeviceData(Dataset):
    """A dataset on one device that makes whole batches itself: batch(index, seed, epoch)
    gives (x, y) on its device, augmented when a seed is given, as a pure function of (seed,
    epoch, sample index); to(device) moves it."""

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def to(self, device: torch.device) -> DeviceData:
        raise NotImplementedError

    def batch(self, index: torch.Tensor, seed: int | None = None, epoch: int = 0):
        raise NotImplementedError


class DeviceLoader:
    """Iterates key batches (the sampler's Keys, or lists of (index, seed, epoch)) over a
    DeviceData dataset and yields the same (x, y, index, replaced) batches a DataLoader over
    SeededSamples would: x and y on the device, index and replaced on the host (CPU int64),
    as the loop reads them there (sample-id logs, skip_bad counts) without a device sync.

    The indices reach the device without stalling the host: a CPU tensor, pinned, copied
    asynchronously (a tensor built from Python data on a CUDA device is a blocking copy)."""

    def __init__(self, data: DeviceData, batches: Iterable, train: bool):
        self.data, self.batches, self.train = data, batches, train
        self.seed = getattr(batches, "seed", 0)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        device = self.data.device
        for keys in self.batches:
            if isinstance(keys, Keys):
                index, epoch = keys.index, keys.epoch
            else:
                index, epoch = torch.tensor([k[0] for k in keys], dtype=torch.long), keys[0][2]
            x, y = self.data.batch(
                to_device(index, device), self.seed if self.train else None, epoch
            )
            yield Sample(x, y, index, torch.zeros(len(index), dtype=torch.long))


def to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on the device, without waiting: pinned first where the copy needs it
    (CUDA's caching host allocator keeps the pinned block until the copy has run)."""
    if device.type == "cpu":
        return index
    if device.type == "cuda":
        index = index.pin_memory()
    return index.to(device, non_blocking=True)
