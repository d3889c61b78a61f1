"""Random images of a real dataset's shape: throughput with no data on disk (and no decode)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from engine.vision.images import IMAGENET_MEAN, IMAGENET_STD, normalise_on_device


class SyntheticImages(Dataset):
    """n uint8 images (3, size, size) with labels cycling over the classes; the pixels come
    from torch's RNG, which the loader seeds per sample. uint8 like the decoded images, so the
    copy to the device and the normalisation there cost what they cost with real data."""

    def __init__(self, n: int, num_classes: int, size: int, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.n, self.size, self.mean, self.std = n, size, mean, std
        self.classes = [f"class{c:04d}" for c in range(num_classes)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8)
        return image, i % len(self.classes)

    def finish_on_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        return normalise_on_device(x, device, self.mean, self.std)
