"""Random tensors of a real dataset's shape: throughput with no data on disk (and no decode)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticImages(Dataset):
    """n normalised-looking images (3, size, size) with labels cycling over the classes; the
    values come from torch's RNG, which the loader seeds per sample."""

    def __init__(self, n: int, num_classes: int, size: int):
        self.n, self.size = n, size
        self.classes = [f"class{c:04d}" for c in range(num_classes)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.randn(3, self.size, self.size), i % len(self.classes)
