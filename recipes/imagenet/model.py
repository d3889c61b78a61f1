"""Any torchvision classification model, by name (`model.arch=resnet50`, `vit_b_16`, ...).
Pure model code: the engine sets num_classes from the data when it is 0."""

from dataclasses import dataclass

import torchvision
from torch import nn

from engine.config import ConfigError, bounded


@dataclass
class ModelConfig:
    arch: str = "resnet50"
    num_classes: int = bounded(0, ge=0)  # 0: the number of class folders in train/


def build_model(cfg: ModelConfig) -> nn.Module:
    names = torchvision.models.list_models(module=torchvision.models)
    if cfg.arch not in names:
        raise ConfigError(
            f"model.arch={cfg.arch!r} is not a torchvision classification model; "
            f"e.g. resnet50, resnet18, efficientnet_b0, vit_b_16 ({len(names)} in all)"
        )
    return torchvision.models.get_model(cfg.arch, weights=None, num_classes=cfg.num_classes)
