"""A whole image dataset resident on the training device, gathered and augmented there on
whole batches (the airbench way; engine.data.device.DeviceData, DeviceLoader).

Augmentation draws are a pure function of (seed, epoch, sample index), computed with an
integer hash on the device, so they do not depend on the batch a sample lands in, the number
of processes, or where a run was resumed. torchvision's v2 transforms draw one set of
parameters per call, i.e. per batch, which would tie a sample's augmentation to its batch:
that is why the per-sample flip and translate are written here."""

from __future__ import annotations

from typing import Literal

import torch

from engine.data.device import DeviceData
from engine.seeding import derive_seed

M32 = 0xFFFFFFFF
FLIP_SALT, DX_SALT, DY_SALT = 0xF11B, 0xD0, 0xD1


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors; every product stays below 2**63 (no overflow)."""
    x = x & M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    return (x >> 16) ^ x


def sample_bits(index: torch.Tensor, *key: int) -> torch.Tensor:
    """32 random bits per sample index, a function of (key..., index) alone."""
    return hash32(hash32(index) ^ (derive_seed(*key) & M32))


class DeviceImages(DeviceData):
    """uint8 images (N, C, H, W) and int64 labels; normalised to float on the device.

    flip: "none", "random" (each epoch anew), or "alternate" (airbench: a random first flip per
    sample, then the opposite every other epoch, so each sample is seen both ways equally).
    translate: shift by up to this many pixels, reflect-padded."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        flip: Literal["none", "random", "alternate"] = "none",
        translate: int = 0,
        classes: list[str] | None = None,
    ):
        if images.dtype != torch.uint8 or images.ndim != 4 or len(images) != len(labels):
            raise ValueError("DeviceImages wants uint8 images (N, C, H, W) and N labels")
        self.images, self.labels = images, labels.long()
        self.mean = torch.tensor(mean, device=images.device).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std, device=images.device).view(1, -1, 1, 1) * 255
        self.flip, self.translate = flip, translate
        self.classes = classes

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def device(self) -> torch.device:
        return self.images.device

    def __getitem__(self, i: int):
        x, y = self.batch(torch.tensor([i], device=self.images.device))
        return x[0], y[0]

    def to(self, device: torch.device) -> DeviceImages:
        if self.images.device == device:
            return self
        moved = DeviceImages.__new__(DeviceImages)
        moved.__dict__ |= self.__dict__
        moved.images, moved.labels = self.images.to(device), self.labels.to(device)
        moved.mean, moved.std = self.mean.to(device), self.std.to(device)
        return moved

    def batch(self, index: torch.Tensor, seed: int | None = None, epoch: int = 0):
        """Normalised float images and labels for these indices; augmented when seed is given."""
        x = self.images[index]
        if seed is not None:
            x = self._augment(x, index, seed, epoch)
        return (x.float() - self.mean) / self.std, self.labels[index]

    def _augment(self, x: torch.Tensor, index: torch.Tensor, seed: int, epoch: int):
        if self.flip != "none":
            if self.flip == "alternate":  # fixed per sample, then flipped on odd epochs
                flip = (sample_bits(index, seed, FLIP_SALT) + epoch) & 1
            else:
                flip = sample_bits(index, seed, epoch, FLIP_SALT) & 1
            x = torch.where(flip.bool().view(-1, 1, 1, 1), x.flip(-1), x)
        if self.translate:
            x = self._translate(x, index, seed, epoch)
        return x

    def _translate(self, x: torch.Tensor, index: torch.Tensor, seed: int, epoch: int):
        t, (n, _, h, w) = self.translate, x.shape
        span = 2 * t + 1
        dy = sample_bits(index, seed, epoch, DY_SALT) % span
        dx = sample_bits(index, seed, epoch, DX_SALT) % span
        # reflect padding needs a float tensor; uint8 values survive the round trip exactly
        padded = torch.nn.functional.pad(x.float(), (t, t, t, t), mode="reflect").to(x.dtype)
        rows = (dy.view(n, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1)
        cols = (dx.view(n, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w)
        batch = torch.arange(n, device=x.device).view(n, 1, 1, 1)
        chans = torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1)
        return padded[batch, chans, rows, cols]
