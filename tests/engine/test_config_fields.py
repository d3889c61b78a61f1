"""Resume safety is declared beside each config field (`bounded(..., resume_safe=True)`,
`safe(default)`, `guarded(default)`) or once for a section safe as a whole
(`resume_safe = True`); resume_safe_keys() gathers the declarations for config_changes. Here
every engine key's declaration is checked against the list the checkpoint code held before
the declarations moved beside the fields."""

from __future__ import annotations

import dataclasses

import pytest

from engine import config as C
from engine.checkpoint.state import config_changes

# What a resumed run could change before the declarations moved to the fields: these
# prefixes, except GUARDED.
FORMERLY_SAFE = (
    *("run.", "log.", "ckpt.", "eval.", "slurm.", "fault.", "dist."),
    *("loader.num_workers", "loader.pin_memory", "loader.persistent_workers"),
    *("loader.prefetch_factor", "loader.decode_ahead"),
    *("train.epochs", "train.max_steps", "train.stop_at_step", "train.micro_batch_size"),
    *("train.compile", "train.channels_last", "train.activation_checkpointing", "train.tf32"),
    *("train.cudnn_benchmark", "optim.implementation", "train.nan_policy"),
    *("data.root", "device", "resume", "deterministic", "variant"),
    "prof.",  # added later, safe from the start: what is recorded about a run
)
FORMERLY_GUARDED = ("dist.sync_bn",)


def engine_keys() -> list[tuple[str, type, dataclasses.Field]]:
    return [
        (f"{name}.{f.name}", cls, f)
        for name, cls in C.ENGINE_SECTIONS.items()
        for f in dataclasses.fields(cls)
    ]


def safe_now(key: str) -> bool:
    return key.startswith(C.resume_safe_keys())


def safe_before(key: str) -> bool:
    return key.startswith(FORMERLY_SAFE) and not key.startswith(FORMERLY_GUARDED)


def test_every_engine_field_is_declared_safe_or_not_as_before():
    """Each field's declaration (its own, else its section's) decides it, and it decides as
    the former list did."""
    declared = {key: C.is_resume_safe(cls, f) for key, cls, f in engine_keys()}
    assert all(isinstance(safe, bool) for safe in declared.values())
    assert declared == {key: safe_before(key) for key in declared}
    assert declared == {key: safe_now(key) for key in declared}


def test_top_level_and_recipe_keys_keep_their_safety():
    keys = [*C.TOP_LEVEL, *C.RECORDED, "data.root", "data.batch", "model.width"]
    assert {key: safe_now(key) for key in keys} == {key: safe_before(key) for key in keys}
    assert [key for key in keys if safe_now(key)] == [
        "deterministic",
        "device",
        "resume",
        "variant",
        "data.root",
    ]


@pytest.mark.parametrize(
    ("key", "safe"),
    [
        ("train.epochs", True),
        ("train.compile", True),
        ("loader.num_workers", True),
        ("optim.implementation", True),
        ("dist.timeout_s", True),
        ("run.name", True),
        ("optim.lr", False),
        ("train.batch_size", False),
        ("loader.seed_python_numpy", False),
        ("dist.sync_bn", False),
        ("seed", False),
    ],
)
def test_declared_safety_decides_config_changes(key, safe):
    saved = {}
    C._set_dotted(saved, key, "old")
    current = {}
    C._set_dotted(current, key, "new")
    refused, allowed = config_changes(saved, current)
    assert (allowed, refused) == (
        ([f"{key} old -> new"], []) if safe else ([], [f"{key} old -> new"])
    )


def test_a_section_safe_as_whole_is_one_prefix_and_a_guarded_field_splits_it():
    keys = C.resume_safe_keys()
    assert {"run.", "log.", "ckpt.", "eval.", "slurm.", "fault."} <= set(keys)
    assert "dist." not in keys and "dist.sync_bn" not in keys and "dist.strategy" in keys
    assert C.DistConfig.resume_safe and not C.TrainConfig.__dict__.get("resume_safe", False)
