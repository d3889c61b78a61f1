"""The recipe interface. A recipe is single-device code: a model builder and a dataset
builder, each with a config dataclass of its own. It never touches torch.distributed,
W&B, SLURM or the environment.

A recipe folder holds `config.yaml` and may hold named variants (`v2.yaml`, `fast.yaml`)
layered on it. The first comment line of each file describes it in one line.

Fields the engine reads by name when a recipe's config has them:
  data.root         where the files are; "" resolves to $RECIPES_DATA/<recipe>, else
                    data/<recipe> in the checkout (resolved before the recipe sees it)
  data.skip_bad     replace (deterministically) and count samples whose file cannot be read
  model.num_classes 0 follows the training data (`len(train_dataset.classes)`)"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from engine.config import ConfigError
from engine.tasks import Classification

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
REPO = RECIPES_DIR.parent


@dataclass(frozen=True)
class Recipe:
    model_config: type
    build_model: Callable[..., nn.Module]
    data_config: type
    build_datasets: Callable[..., tuple[Dataset, Dataset]]  # (train, held-out eval)
    # Data-dependent initialisation (model, training dataset), e.g. whitening filters from
    # the images; deterministic, so every rank computes the same weights.
    prepare: Callable[[nn.Module, Dataset], None] | None = None
    # The shape of one input sample given the data config, e.g. (3, 224, 224): the engine
    # counts the model's FLOPs per sample from it and logs MFU where the device's peak is known.
    sample_shape: Callable[..., tuple[int, ...]] | None = None
    # What training minimises and evaluation reports (engine.tasks): classification by default.
    task: Any = field(default_factory=Classification)
    # The units that FSDP shards and activation checkpointing recomputes one at a time, e.g.
    # the transformer blocks (torchtitan's per-block plan); None: the whole model is one unit.
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None
    # init_weights(model_config, name, tensor, generator) fills the parameter or buffer `name`
    # in place. Given, the model is built on the meta device and each tensor is initialised
    # from a generator seeded by (seed, name): the same weights for any world size and
    # strategy, and a model larger than one process's memory can start sharded.
    init_weights: Callable[[Any, str, torch.Tensor, torch.Generator], None] | None = None
    # Declared training FLOPs per sample (forward + backward) from (model config, data config),
    # e.g. 6N + attention per token x tokens; None: counted from sample_shape.
    flops_per_sample: Callable[[Any, Any], float] | None = None
    # Units of the task (e.g. tokens) per sample from the data config: logged as <unit>_per_s.
    units_per_sample: Callable[[Any], int] | None = None


def available() -> list[str]:
    return sorted(p.parent.name for p in RECIPES_DIR.glob("*/config.yaml"))


def config_path(name: str) -> Path:
    path = RECIPES_DIR / name / "config.yaml"
    if not name.isidentifier() or not path.exists():
        raise ConfigError(f"unknown recipe '{name}'; available: {', '.join(available())}")
    return path


def variants(name: str) -> list[str]:
    """The recipe's named configs besides config.yaml, sorted."""
    folder = config_path(name).parent
    return sorted(p.stem for p in folder.glob("*.yaml") if p.stem != "config")


def variant_path(name: str, variant: str) -> Path:
    known = variants(name)
    if variant not in known:
        have = ", ".join(known) if known else "none (only config.yaml)"
        raise ConfigError(f"recipe '{name}' has no variant '{variant}'; available: {have}")
    return RECIPES_DIR / name / f"{variant}.yaml"


def default_data_root(name: str, recipes_data: str | None) -> str:
    """$RECIPES_DATA/<recipe> (the container sets RECIPES_DATA=/data), else data/<recipe>
    in the checkout, where launch mounts the host's data folder."""
    base = Path(recipes_data) if recipes_data else REPO / "data"
    return str(base / name)


def load(name: str) -> Recipe:
    config_path(name)
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE
