"""Where recipes live and how their config files are layered, for the engine and launch alike.

`--config` (CONFIG=) names a variant (recipes/<recipe>/<name>.yaml) or, when it holds a '/'
or ends in .yaml/.yml, a config file, such as a run's saved config.yaml. Either is layered on
the recipe's config.yaml; a file that records `variant: NAME` is layered on that variant.

Torch-free, so launch lists recipes and reads their `slurm:` sections without importing torch;
only `load` imports a recipe's code."""

from __future__ import annotations

import dataclasses
import importlib
import os
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import recipe as contract
from engine.config import (
    ENGINE_SECTIONS,
    Config,
    ConfigError,
    build_section,
    merge,
    parse_overrides,
    read_yaml,
    resolve,
)

if TYPE_CHECKING:
    from engine.recipe import Recipe

# What launch renders from: the run's place and the scheduler's request. The other sections
# (a sweep's grid may hold comma lists there) are the engine's check's to validate.
LAUNCH_SECTIONS = ("run", "slurm")
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
REPO = RECIPES_DIR.parent
# A recipe folder's YAML files that are not variants: the base config, and the results
# `make reproduce` checks (a record of runs, not a config to train from).
RESULTS_FILE = "results.yaml"
NOT_VARIANTS = ("config", Path(RESULTS_FILE).stem)


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
    """The recipe's named configs besides config.yaml (and results.yaml), sorted."""
    recipe_dir = config_path(name, folder).parent
    return sorted(p.stem for p in recipe_dir.glob("*.yaml") if p.stem not in NOT_VARIANTS)


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


def decide_data_root(given: str, name: str, recipes_data: str | None) -> str:
    """The one rule for a recipe's data root: data.root as given, else $RECIPES_DATA/<recipe>
    (a container sets RECIPES_DATA=/data, where launch mounts the host's data folder), else
    data/<recipe> in the checkout."""
    if given:
        return given
    base = Path(recipes_data) if recipes_data else REPO / "data"
    return str(base / name)


def requested_sections(
    name: str, config: str, overrides: typing.Sequence[str], folder: Path = RECIPES_DIR
) -> tuple[str, dict[str, Any]]:
    """(the variant, the run and slurm sections and the top-level device, as the engine
    resolves them): defaults <
    config.yaml < the variant or config file < overrides, layered by the same code as
    `resolve`. Torch-free, for launch, which renders the scheduler's request and the run
    directory from these; the recipe's sections, which need its code, are left to the
    engine's check of the same request."""
    variant, layer = config_layer(name, config, folder)
    tree = parse_overrides(overrides, dict(ENGINE_SECTIONS))
    merged = merge(merge(read_yaml(config_path(name, folder)), layer), tree)
    sections = {}
    for section in LAUNCH_SECTIONS:
        cls = ENGINE_SECTIONS[section]
        values = merged.get(section)
        sections[section] = build_section(section, cls, {} if values is None else values)
    sections["device"] = merged.get("device", "auto")  # checked by the engine's own check
    return variant, sections


def load(name: str) -> Recipe:
    config_path(name)
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE


def load_config(name: str, overrides: list[str], config: str = "") -> tuple[Config, Recipe]:
    """The resolution of a request: engine defaults < config.yaml < the variant's yaml or a
    config file < overrides. `config`: a variant's name or a config file's path. Runs once
    per launch (launch's check, or the one process it starts); the processes of a launch
    read its result (read_resolved)."""
    count_resolution()
    recipe_yaml = read_yaml(config_path(name))
    variant, layer = config_layer(name, config)
    recipe = load(name)
    return resolve(name, recipe_yaml, overrides, recipe_sections(recipe), variant, layer), recipe


def recipe_sections(recipe: Recipe) -> dict[str, type]:
    """The config sections a recipe brings: its model's and its data's."""
    return {"model": recipe.model_config, "data": recipe.data_config}


def read_resolved(name: str, path: str) -> tuple[Config, Recipe]:
    """A config resolved before (a launch's frozen request, `--resolved FILE`): every key is
    in the file, so it is read alone, with no layer under or over it, each key validated as
    any config file's are."""
    layer = read_config_file(path)
    recorded = layer.get("recipe")
    if recorded != name:
        raise ConfigError(f"--resolved {path} is a config of recipe {recorded!r}, not of {name!r}")
    variant = layer.get("variant") or ""
    recipe = load(name)
    return resolve(name, {}, [], recipe_sections(recipe), variant, layer), recipe


RESOLUTIONS_LOG = "RECIPES_RESOLUTIONS_LOG"  # tests: a file each resolution appends a line to


def count_resolution() -> None:
    """One line (the process id and its rank) per resolution, where the tests ask for it."""
    log = os.environ.get(RESOLUTIONS_LOG)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} rank={os.environ.get('RANK', '-')}\n")


def data_here(cfg: Config) -> Any:
    """The data section as this machine reads it: data.root decided here (decide_data_root),
    never written back into the config, which keeps what was asked ("" follows the machine)."""
    asked = contract.data_root(cfg.data)
    if asked is None:
        return cfg.data
    root = decide_data_root(asked, cfg.recipe, os.environ.get("RECIPES_DATA"))
    return dataclasses.replace(cfg.data, root=root)
