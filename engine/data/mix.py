"""MixUp and CutMix on training batches: torchvision.transforms.v2's transforms, with their
random draws (lambda, box, which of the two) taken from a CPU generator seeded per micro batch
from (seed, epoch, position of the micro batch's first sample in the epoch).

The partner of each sample is its neighbour in the micro batch (torchvision's roll by one).
A micro batch's position and content do not depend on the number of processes (see the
sampler), so 1 process with 2 accumulation steps and 2 processes with 1 mix alike."""

from __future__ import annotations

import torch

from engine.config import ConfigError, MixConfig
from engine.seeding import derive_seed

MIX_SALT = 0x313


class BatchMix:
    def __init__(self, cfg: MixConfig, num_classes: int, seed: int):
        from torchvision.transforms import v2  # start-up time: ~2 s, only for runs that mix

        transforms = []
        if cfg.mixup_alpha > 0:
            transforms.append(v2.MixUp(alpha=cfg.mixup_alpha, num_classes=num_classes))
        if cfg.cutmix_alpha > 0:
            transforms.append(v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=num_classes))
        self.transform = transforms[0] if len(transforms) == 1 else v2.RandomChoice(transforms)
        self.seed = seed

    def __call__(self, x: torch.Tensor, y: torch.Tensor, epoch: int, position: int):
        """(mixed images, soft labels); the caller's RNG state is left as it was."""
        saved = torch.default_generator.get_state()
        try:
            torch.default_generator.manual_seed(derive_seed(self.seed, epoch, position, MIX_SALT))
            return self.transform(x, y)
        finally:
            torch.default_generator.set_state(saved)


def build_mix(cfg: MixConfig, num_classes: int | None, seed: int) -> BatchMix | None:
    if cfg.mixup_alpha <= 0 and cfg.cutmix_alpha <= 0:
        return None
    if not num_classes:
        raise ConfigError("mix needs the number of classes: set model.num_classes")
    return BatchMix(cfg, num_classes, seed)
