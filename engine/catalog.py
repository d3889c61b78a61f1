"""Where recipes live and how their config files are layered, for the engine and launch alike.

`--config` (CONFIG=) names a variant (recipes/<recipe>/<name>.yaml) or, when it holds a '/'
or ends in .yaml/.yml, a config file, such as a run's saved config.yaml. Either is layered on
the recipe's config.yaml; a file that records `variant: NAME` is layered on that variant.

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


def is_config_file(config: str) -> bool:
    """`--config` names a file (a path: it holds a '/' or ends in .yaml/.yml), else a variant."""
    return "/" in config or config.endswith((".yaml", ".yml"))


def read_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        what = "is a directory, not a config file" if file.is_dir() else "not found"
        raise ConfigError(f"config file {path} {what}")
    return read_yaml(file)


def file_recipe(path: str) -> str:
    """The recipe a config file records (`recipe:`), "" when it names none."""
    recipe = read_config_file(path).get("recipe") or ""
    if not isinstance(recipe, str):
        raise ConfigError(f"{path}: recipe must be a recipe's name, got {recipe!r}")
    return recipe


def config_layer(
    name: str, config: str = "", folder: Path = RECIPES_DIR
) -> tuple[str, dict[str, Any]]:
    """(the variant, what is layered on config.yaml) for `--config`: a variant's file, or a
    config file over the variant it records (a saved config holds every key anyway)."""
    if not is_config_file(config):
        return config, read_yaml(variant_path(name, config, folder)) if config else {}
    layer = read_config_file(config)
    recorded = layer.get("recipe") or name
    if recorded != name:
        raise ConfigError(f"{config} is a config of recipe {recorded!r}, not of {name!r}")
    variant = layer.get("variant") or ""
    if not isinstance(variant, str):
        raise ConfigError(f"{config}: variant must be a variant's name, got {variant!r}")
    base = read_yaml(variant_path(name, variant, folder)) if variant else {}
    return variant, merge(base, layer)


def layered_yaml(
    name: str, config: str = "", folder: Path = RECIPES_DIR
) -> tuple[str, dict[str, Any]]:
    """(the variant, config.yaml with the variant's file or the config file (`--config`)
    layered on it): the recipe's part of a config, before the engine's defaults and the
    overrides (what launch reads for `slurm:`). A config file's variant is the one it records."""
    variant, layer = config_layer(name, config, folder)
    return variant, merge(read_yaml(config_path(name, folder)), layer)


def default_data_root(name: str, recipes_data: str | None) -> str:
    """$RECIPES_DATA/<recipe> (the container sets RECIPES_DATA=/data), else data/<recipe>
    in the checkout, where launch mounts the host's data folder."""
    base = Path(recipes_data) if recipes_data else REPO / "data"
    return str(base / name)


def load(name: str) -> Recipe:
    config_path(name)
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE


def load_config(name: str, overrides: list[str], config: str = "") -> tuple[Config, Recipe]:
    """engine defaults < config.yaml < the variant's yaml or a config file < overrides;
    data.root resolved. `config`: a variant's name or a config file's path."""
    recipe_yaml = read_yaml(config_path(name))
    variant, layer = config_layer(name, config)
    recipe = load(name)
    sections = {"model": recipe.model_config, "data": recipe.data_config}
    cfg = resolve(name, recipe_yaml, overrides, sections, variant, layer)
    if getattr(cfg.data, "root", None) == "":
        cfg.data.root = default_data_root(name, os.environ.get("RECIPES_DATA"))
    return cfg, recipe
