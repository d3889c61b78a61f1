"""CIFAR-10 from the official python batches (`<data.root>/cifar-10-batches-py`).

Two ways to feed it: per sample through the engine's DataLoader (random crop with zero
padding and a flip, torchvision.transforms.v2), or, with `on_device`, the whole set on the
training device as uint8 and augmented there on whole batches (flip, reflect-padded
translate), the airbench way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from engine.config import ConfigError, bounded
from engine.vision.device import DeviceImages
from recipes.cifar10 import cifar_files

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


@dataclass
class DataConfig:
    root: str = ""  # "" : $RECIPES_DATA/cifar10 or data/cifar10 in the checkout
    download: bool = False  # fetch the official archive with torchvision where the network allows
    on_device: bool = False  # the whole set on the device, augmented on whole batches
    # Random crop after this much padding (a translate of up to this much).
    padding: int = bounded(4, ge=0)
    flip: Literal["none", "random", "alternate"] = "random"  # alternate: on_device only


class CifarImages(Dataset):
    """uint8 images (N, 3, 32, 32) with a per-sample transform to normalised float."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform, classes):
        self.images, self.labels, self.transform = images, labels, transform
        self.classes = classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), int(self.labels[i])


def _per_sample(cfg: DataConfig, train: bool) -> v2.Compose:
    steps = []
    if train and cfg.padding:
        steps.append(v2.RandomCrop(32, padding=cfg.padding))
    if train and cfg.flip != "none":
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def check_data(cfg: DataConfig) -> None:
    """The seven official files at data.root, unless data.download fetches them."""
    if not cfg.download:
        cifar_files.require(Path(cfg.root))


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    root = Path(cfg.root)
    if cfg.download:
        cifar_files.download(root)
    cifar_files.require(root)
    classes = cifar_files.read_classes(root)
    (train_x, train_y), (test_x, test_y) = (cifar_files.read_split(root, t) for t in (True, False))
    if cfg.on_device:
        train = DeviceImages(train_x, train_y, MEAN, STD, cfg.flip, cfg.padding, classes)
        return train, DeviceImages(test_x, test_y, MEAN, STD, classes=classes)
    if cfg.flip == "alternate":
        raise ConfigError("data.flip=alternate needs data.on_device=true; use data.flip=random")
    return (
        CifarImages(train_x, train_y, _per_sample(cfg, True), classes),
        CifarImages(test_x, test_y, _per_sample(cfg, False), classes),
    )


def normalised(data: Dataset, n: int) -> torch.Tensor:
    """The first n training images, normalised, unaugmented (for data-dependent init)."""
    images = data.images[:n].float() / 255
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return (images.cpu() - mean) / std
