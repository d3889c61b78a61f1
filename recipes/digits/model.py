"""A small CNN for 8x8 digit images. Pure model code: no distributed, no I/O."""

from dataclasses import dataclass
from typing import Literal

from torch import nn

from engine.config import bounded


@dataclass
class ModelConfig:
    width: int = bounded(32, ge=1)
    norm: Literal["batch", "group", "none"] = "batch"  # none/group: no batch statistics
    dropout: float = bounded(0.0, ge=0, lt=1)
    num_classes: int = bounded(10, ge=0)  # 0: follows the training data


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(8, channels)
    return nn.Identity()


def _block(c_in: int, c_out: int, norm: str) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=norm == "none"),
        _norm(norm, c_out),
        nn.ReLU(),
    ]


def build_model(cfg: ModelConfig) -> nn.Module:
    w = cfg.width
    return nn.Sequential(
        *_block(1, w, cfg.norm),
        *_block(w, w, cfg.norm),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        *_block(w, 2 * w, cfg.norm),
        *_block(2 * w, 2 * w, cfg.norm),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(cfg.dropout),
        nn.Linear(2 * w, cfg.num_classes),
    )
