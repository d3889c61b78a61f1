"""Each recipe's own test settings: `recipes/<name>/tiny.yml` (not a variant: the engine and
launch list only *.yaml), layered over config.yaml and each variant as overrides, and, for a
recipe that reads files, its example data (Recipe.example_data) written in the real format."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from engine import catalog
from engine.config import read_yaml

TINY = "tiny.yml"


def tiny_path(recipe: str) -> Path:
    return catalog.RECIPES_DIR / recipe / TINY


def as_overrides(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """A config tree as dotted key=value overrides that the engine reads back as the same
    values: text as written, everything else in YAML's flow style."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += as_overrides(value, f"{prefix}{key}.")
            continue
        if not isinstance(value, str):
            value = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
            value = value.removesuffix("\n").removesuffix("\n...")
        out.append(f"{prefix}{key}={value}")
    return out


def tiny_overrides(recipe: str, data: Path) -> list[str]:
    """The recipe's tiny.yml as overrides, with data.root at its example data, written under
    data/<recipe> (when the recipe reads files)."""
    overrides = as_overrides(read_yaml(tiny_path(recipe)))
    write = catalog.load(recipe).example_data
    if write is not None:
        root = data / recipe
        write(root)
        overrides.append(f"data.root={root}")
    return overrides
