"""The last step of resolution: what is known only once the run starts, set in one place.

A resolved config holds what was asked. A few values are derived afterwards, by the engine,
from facts the request cannot know: the run's name (launch's, else a new one, agreed by every
rank), the class count of a `model.num_classes=0` model (the training data's), a named
weights file's evaluation preprocessing, and the settings that make an evaluation score
exactly the weights it was given. Each is set here, checked by its field's type and range as an
override is, and nowhere else: `grep -rn "finalize(" engine` lists every derivation.
Machine facts (device, data root, hosts) are not settings: they go to env.json."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.config.fields import ConfigError, _check_range, _check_type, type_hints
from engine.config.sections import Config

TOP_LEVEL_DERIVED = ("resume",)  # top-level keys a derivation may set (scoring: resume=none)
# Keys whose asked value means "derive me at set-up", and that value: a request asking it
# is the same request as a run's config.yaml that holds what set-up derived.
DERIVED_AT_START = {"model.num_classes": 0}


def finalize(cfg: Config, derived: Mapping[str, Any]) -> Config:
    """cfg with each dotted key of `derived` set to its value, validated; returns cfg."""
    for dotted, value in derived.items():
        if dotted in TOP_LEVEL_DERIVED:
            setattr(cfg, dotted, value)
            continue
        *path, leaf = dotted.split(".")
        owner = cfg
        for part in path:
            owner = getattr(owner, part)
        fields = {f.name: f for f in dataclasses.fields(owner)}
        if leaf not in fields:
            raise ConfigError(f"finalize: {dotted!r} is not a config key")
        checked = _check_type(dotted, value, type_hints(type(owner))[leaf])
        _check_range(dotted, checked, fields[leaf].metadata.get("range"))
        setattr(owner, leaf, checked)
    return cfg
