"""A small MLP for the 10 diabetes features. Pure model code: no distributed, no I/O."""

from dataclasses import dataclass

from torch import nn

from engine.config import bounded
from recipes.diabetes.data import FEATURES


@dataclass
class ModelConfig:
    width: int = bounded(64, ge=1)  # units of each hidden layer
    depth: int = bounded(2, ge=1)  # hidden layers
    dropout: float = bounded(0.0, ge=0, lt=1)  # before the output layer


def build_model(cfg: ModelConfig) -> nn.Module:
    layers: list[nn.Module] = []
    size = FEATURES
    for _ in range(cfg.depth):
        layers += [nn.Linear(size, cfg.width), nn.ReLU()]
        size = cfg.width
    return nn.Sequential(*layers, nn.Dropout(cfg.dropout), nn.Linear(size, 1))
