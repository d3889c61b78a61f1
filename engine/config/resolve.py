"""Resolution: engine defaults < recipe config.yaml < variant < dotted CLI overrides, layered,
checked key by key and across fields, and written back as YAML.

Validation happens before anything is written, and every mistake is reported as one line
(ConfigError)."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from engine.config.fields import (
    YAML_FAILURES,
    ConfigError,
    _check_range,
    _check_type,
    _closest,
    build_section,
    dump_yaml,
    load_yaml,
    parse_overrides,
)
from engine.config.sections import (
    ENGINE_SECTIONS,
    TOP_LEVEL,
    TOP_RANGES,
    TOP_TYPES,
    Config,
    with_weights_init,
)


def merge(base: dict, update: dict) -> dict:
    """update layered over base, section by section."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = load_yaml(path.read_text())
    except UnicodeDecodeError:  # before YAML_FAILURES, which holds its base, ValueError
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except YAML_FAILURES as err:
        raise ConfigError(f"{path}: not valid YAML ({_first_line(err)})") from None
    if data is None:  # an empty file, or only comments
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _first_line(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def description(path: Path) -> str:
    """The first comment line of a config file: what it trains, in one line."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def resolve(
    recipe: str,
    recipe_yaml: dict[str, Any],
    overrides: typing.Sequence[str],
    recipe_sections: dict[str, type],
    variant: str = "",
    variant_yaml: dict[str, Any] | None = None,
) -> Config:
    """Layer defaults < recipe_yaml < variant_yaml < overrides; validate every key and type."""
    if "model" in recipe_sections:  # every model section takes the fine-tuning keys
        recipe_sections = recipe_sections | {"model": with_weights_init(recipe_sections["model"])}
    section_types = ENGINE_SECTIONS | recipe_sections
    tree = parse_overrides(overrides, TOP_TYPES | section_types)
    merged = merge(merge(recipe_yaml, variant_yaml or {}), tree)
    valid = [*TOP_LEVEL, *RECORDED, *section_types]
    top = dict(TOP_LEVEL)
    sections = {}
    for key, value in merged.items():
        if key in RECORDED:
            _check_recorded(key, value, {"recipe": recipe, "variant": variant}[key])
        elif key in TOP_LEVEL:
            top[key] = _check_type(key, value, TOP_TYPES[key])
            _check_range(key, top[key], TOP_RANGES.get(key))
        elif key not in section_types:
            raise ConfigError(f"unknown config key {key!r}{_closest(key, valid)}")
    for name, cls in section_types.items():
        values = merged.get(name)  # `optim:` with nothing under it is an empty section
        sections[name] = build_section(name, cls, {} if values is None else values)
    cfg = Config.from_sections(recipe, sections, variant, **top)
    validate(cfg)
    return cfg


RECORDED = ("recipe", "variant")  # in a resolved config: what it was resolved from


def _check_recorded(key: str, value: Any, chosen: str) -> None:
    """A saved config records its recipe and variant; both are chosen by name, so a recorded
    value must be the one chosen."""
    if (value or "") == chosen:
        return
    if key == "recipe":
        raise ConfigError(f"recipe={value!r} in the config, but the recipe run is {chosen!r}")
    raise ConfigError(
        f"variant={value!r}: a variant is chosen by name (CONFIG=NAME, --config NAME), "
        "not set as a key"
    )


def validate(cfg: Config) -> None:
    """Rules across fields; each field's own range is declared beside it (`bounded`)."""
    train, opt = cfg.train, cfg.optim
    if train.epochs < 1 and train.max_steps < 1:
        raise ConfigError("set train.epochs >= 1 or train.max_steps >= 1")
    if len(opt.betas) != 2:
        raise ConfigError(f"optim.betas needs two values, got {opt.betas}")
    sched = cfg.sched
    if sched.warmup_steps and sched.warmup_epochs or sched.milestones and sched.milestone_epochs:
        raise ConfigError("sched: give warmup (or milestones) in steps or in epochs, not both")
    if any(ch in cfg.run.name for ch in "/\\") or cfg.run.name in (".", ".."):
        raise ConfigError(f"run.name '{cfg.run.name}' must be a plain name, not a path")


def dump(cfg: Config) -> str:
    """The resolved config as YAML; loading it as a recipe config gives the same Config."""
    return dump_yaml(cfg.to_dict())
