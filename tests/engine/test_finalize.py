"""A resolved config changes in one place: config.finalize, which checks each derived value
as an override is checked."""

import re

import pytest

from engine import config as C
from engine.catalog import load_config
from tests.helpers import REPO


def test_finalize_sets_derived_values_checked_by_type_and_range():
    cfg = load_config("digits", [])[0]
    C.finalize(cfg, {"run.name": "named", "model.num_classes": 7, "resume": "none"})
    assert (cfg.run.name, cfg.model.num_classes, cfg.resume) == ("named", 7, "none")
    with pytest.raises(C.ConfigError, match="model.num_classes must be >= 0"):
        C.finalize(cfg, {"model.num_classes": -1})
    with pytest.raises(C.ConfigError, match="expected int"):
        C.finalize(cfg, {"train.batch_size": "64"})
    with pytest.raises(C.ConfigError, match="not a config key"):
        C.finalize(cfg, {"train.epohcs": 3})


# `cfg.x.y = ...` or `cfg.x.y, cfg.x.z = ...` at the start of a statement
ASSIGNMENT = re.compile(r"^\s*cfg(\.\w+)+(, cfg(\.\w+)+)* = ")


def test_no_engine_module_edits_a_resolved_config_but_through_finalize():
    edits = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "engine").rglob("*.py"))
        if "config" not in path.relative_to(REPO / "engine").parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ASSIGNMENT.search(line)
    ]
    assert edits == []
