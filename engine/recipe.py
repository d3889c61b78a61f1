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
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from engine.config import Config, ConfigError, merge, read_yaml, resolve
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


def available(folder: Path = RECIPES_DIR) -> list[str]:
    """The recipes: folders under `folder` holding a config.yaml."""
    return sorted(p.parent.name for p in folder.glob("*/config.yaml"))


def config_path(name: str, folder: Path = RECIPES_DIR) -> Path:
    path = folder / name / "config.yaml"
    if not name.isidentifier() or not path.exists():
        raise ConfigError(f"unknown recipe '{name}'; available: {', '.join(available(folder))}")
    return path


def variants(name: str, folder: Path = RECIPES_DIR) -> list[str]:
    """The recipe's named configs besides config.yaml, sorted."""
    recipe_dir = config_path(name, folder).parent
    return sorted(p.stem for p in recipe_dir.glob("*.yaml") if p.stem != "config")


def variant_path(name: str, variant: str, folder: Path = RECIPES_DIR) -> Path:
    known = variants(name, folder)
    if variant not in known:
        have = ", ".join(known) if known else "none (only config.yaml)"
        raise ConfigError(f"recipe '{name}' has no variant '{variant}'; available: {have}")
    return folder / name / f"{variant}.yaml"


def layered_yaml(name: str, variant: str = "", folder: Path = RECIPES_DIR) -> dict[str, Any]:
    """config.yaml with the variant's file layered on it: the recipe's part of a config,
    before the engine's defaults and the overrides (what launch reads for `slurm:`)."""
    base = read_yaml(config_path(name, folder))
    return merge(base, read_yaml(variant_path(name, variant, folder))) if variant else base


def default_data_root(name: str, recipes_data: str | None) -> str:
    """$RECIPES_DATA/<recipe> (the container sets RECIPES_DATA=/data), else data/<recipe>
    in the checkout, where launch mounts the host's data folder."""
    base = Path(recipes_data) if recipes_data else REPO / "data"
    return str(base / name)


def load(name: str) -> Recipe:
    config_path(name)
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE


def load_config(name: str, overrides: list[str], variant: str = "") -> tuple[Config, Recipe]:
    """engine defaults < config.yaml < the variant's yaml < overrides; data.root resolved."""
    recipe_yaml = read_yaml(config_path(name))
    variant_yaml = read_yaml(variant_path(name, variant)) if variant else {}
    recipe = load(name)
    sections = {"model": recipe.model_config, "data": recipe.data_config}
    cfg = resolve(name, recipe_yaml, overrides, sections, variant, variant_yaml)
    if getattr(cfg.data, "root", None) == "":
        cfg.data.root = default_data_root(name, os.environ.get("RECIPES_DATA"))
    return cfg, recipe
