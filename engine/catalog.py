"""Where recipes live and how their config files are layered, for the engine and launch alike.

Torch-free, so launch lists recipes and reads their `slurm:` sections without importing torch;
only `load` imports a recipe's code."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import Config, ConfigError, merge, read_yaml, resolve

if TYPE_CHECKING:
    from engine.recipe import Recipe

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
REPO = RECIPES_DIR.parent


def available(folder: Path = RECIPES_DIR) -> list[str]:
    """The recipes: folders under `folder` holding a config.yaml, named as Python modules."""
    return sorted(
        p.parent.name for p in folder.glob("*/config.yaml") if p.parent.name.isidentifier()
    )


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
