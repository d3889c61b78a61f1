"""The per-sample decode + augment pipeline for image folders, from torchvision.transforms.v2,
configured by one dataclass that any image recipe nests in its data section
(`data.augment.trivial_augment=true`).

The per-sample transforms work on uint8 and end in uint8: the batch crosses to the device as
uint8 (4x fewer bytes than float32) and is normalised there (`normalise_on_device`), so the
loader workers do no float work. Training: RandomResizedCrop, flip, optionally
TrivialAugmentWide and RandomErasing. Evaluation: resize, centre crop.
Progressive resizing (FFCV's low-res training): the training crop grows with the epoch; the
epoch reaches the transform through set_epoch, called per sample by the engine's loader, so
it works in persistent workers and after a resume."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchvision.transforms import v2

from engine import recipe as contract
from engine.config import ConfigError, bounded, finalize

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class ImageAugment:
    train_size: int = bounded(224, ge=1)  # training crop (the final one, with progressive resizing)
    scale_min: float = bounded(0.08, gt=0, le=1)  # RandomResizedCrop's smallest area fraction
    hflip: bool = True
    trivial_augment: bool = False  # TrivialAugmentWide
    random_erasing: float = bounded(0.0, ge=0, le=1)  # probability per image
    eval_resize: int = bounded(256, ge=1)  # the shorter side before the centre crop
    eval_size: int = bounded(224, ge=1)  # the centre crop
    # Resizing, in training crops and for evaluation (torchvision's weights name theirs).
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    # With model.weights: eval_resize, eval_size and interpolation are the weights' own
    # (their transforms()); false: this section's values.
    follow_weights: bool = True
    ramp_from_size: int = bounded(0, ge=0)  # > 0: progressive resizing from this size to train_size
    ramp_start_epoch: int = bounded(0, ge=0)  # ... starting to grow at this epoch
    ramp_end_epoch: int = bounded(0, ge=0)  # ... reaching train_size here


def ramp_size(cfg: ImageAugment, epoch: int) -> int:
    """FFCV's schedule: linear from ramp_from_size to train_size over the ramp epochs,
    rounded to a multiple of 32 (a friendly shape for convolution kernels)."""
    if cfg.ramp_from_size <= 0 or cfg.ramp_end_epoch <= cfg.ramp_start_epoch:
        return cfg.train_size
    lo, hi = cfg.ramp_start_epoch, cfg.ramp_end_epoch
    t = min(1.0, max(0.0, (epoch - lo) / (hi - lo)))
    size = cfg.ramp_from_size + t * (cfg.train_size - cfg.ramp_from_size)
    return max(32, int(round(size / 32)) * 32)


def mean_colour(mean) -> list[int]:
    """The mean colour in 0..255, rounded: what normalised 0 is in uint8."""
    return [round(m * 255) for m in mean]


@functools.lru_cache(maxsize=8)
def _device_stats(mean: tuple, std: tuple, device: torch.device):
    # made once per device: building them per batch would copy to the device every step
    scale = torch.tensor([mean, std], dtype=torch.float32, device=device) * 255
    return scale[0].view(1, -1, 1, 1), scale[1].view(1, -1, 1, 1)


def normalise_on_device(x: torch.Tensor, device: torch.device, mean, std) -> torch.Tensor:
    """A uint8 NCHW batch to normalised float32 on the device: the copy is of uint8 (pinned
    memory makes it asynchronous), the float work runs there."""
    m, s = _device_stats(tuple(mean), tuple(std), torch.device(device))
    return (x.to(device, non_blocking=True).float() - m) / s


class TrainTransform:
    """uint8 CHW in, uint8 CHW out (normalised on the device); the crop size follows the epoch."""

    def __init__(self, cfg: ImageAugment, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.cfg, self.mean, self.std = cfg, mean, std
        self.size = None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        size = ramp_size(self.cfg, epoch)
        if size == self.size:
            return
        cfg, self.size = self.cfg, size
        self.crop = v2.RandomResizedCrop(
            size, scale=(cfg.scale_min, 1.0), interpolation=interpolation(cfg), antialias=True
        )
        steps = [self.crop]
        if cfg.hflip:
            steps.append(v2.RandomHorizontalFlip())
        if cfg.trivial_augment:
            steps.append(v2.TrivialAugmentWide())
        if cfg.random_erasing > 0:
            # torchvision's reference erases after normalising, to 0: the mean colour. Here it
            # runs on uint8 before normalising, so it erases to the mean colour in 0..255.
            steps.append(v2.RandomErasing(p=cfg.random_erasing, value=mean_colour(self.mean)))
        self.pipeline = v2.Compose(steps)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self.pipeline(image)


def eval_transform(cfg: ImageAugment) -> v2.Compose:
    """uint8 CHW in, uint8 CHW out: resize the shorter side, then the centre crop."""
    resize = v2.Resize(cfg.eval_resize, interpolation=interpolation(cfg), antialias=True)
    return v2.Compose([resize, v2.CenterCrop(cfg.eval_size)])


def interpolation(cfg: ImageAugment) -> v2.InterpolationMode:
    return v2.InterpolationMode(cfg.interpolation)


# ---------------------------------------------------------------- the weights' preprocessing


def follow_weights(cfg: Any, transforms_of: Callable[[str], Any]) -> str:
    """With model.weights, the image recipe's eval resize, crop and interpolation become the
    weights' own (unless data.augment.follow_weights=false), set through config.finalize so
    the saved config and a resume see them. Returns what the run uses, in words ("" for no
    weights named). transforms_of(name): the named weights' preprocessing as torchvision's
    weights entry gives it (engine.weights.sources.transforms_of)."""
    name = contract.weights_name(cfg.model)
    augment = contract.augment(cfg.data)
    if not name:
        return ""
    if not hasattr(augment, "follow_weights"):
        return "the recipe's (its data section has no image preprocessing to set)"
    if not augment.follow_weights:
        return "the config's (data.augment.follow_weights=false)"
    ours = transforms_of(name)
    if not _same(ours.mean, IMAGENET_MEAN) or not _same(ours.std, IMAGENET_STD):
        raise ConfigError(
            f"model.weights={name} normalises with mean {list(ours.mean)}, std {list(ours.std)}; "
            "the image pipeline uses ImageNet's: set data.augment.follow_weights=false to go on"
        )
    derived = {
        "data.augment.eval_resize": ours.resize_size[0],
        "data.augment.eval_size": ours.crop_size[0],
        "data.augment.interpolation": ours.interpolation.value,
    }
    finalize(cfg, derived)
    return (
        f"the weights' ({name}): resize {augment.eval_resize}, crop {augment.eval_size}, "
        f"{augment.interpolation}"
    )


def _same(a, b) -> bool:
    return all(abs(x - y) < 1e-6 for x, y in zip(a, b, strict=True))
