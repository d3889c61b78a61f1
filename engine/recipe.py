"""The recipe interface. A recipe is single-device code: a model builder and a dataset
builder, each with a config dataclass of its own. It never touches torch.distributed,
W&B, SLURM or the environment."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset

from engine.config import ConfigError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass(frozen=True)
class Recipe:
    model_config: type
    build_model: Callable[..., nn.Module]
    data_config: type
    build_datasets: Callable[..., tuple[Dataset, Dataset]]  # (train, held-out eval)
    loss: Callable | None = None  # default: cross entropy


def available() -> list[str]:
    return sorted(p.parent.name for p in RECIPES_DIR.glob("*/config.yaml"))


def config_path(name: str) -> Path:
    path = RECIPES_DIR / name / "config.yaml"
    if not name.isidentifier() or not path.exists():
        raise ConfigError(f"unknown recipe '{name}'; available: {', '.join(available())}")
    return path


def load(name: str) -> Recipe:
    config_path(name)
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE
