"""One run name, one request: what a run directory was trained from, compared key by key with
a request under the same name.

A run directory's request is its saved config.yaml (the resolved config, redacted). A later
launch, submission, queued job or sweep member under that name may change only what a
resumed run may change (the keys each field declares resume-safe: logging, evaluation,
checkpointing, process count, the training's length...); any other difference is refused in
one line naming the keys, so a result is never what its name does not say. Torch-free:
launch's checks and the engine's start read the same rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config.fields import YAML_FAILURES, ConfigError, dump_yaml, load_yaml
from engine.config.finalize import DERIVED_AT_START
from engine.config.sections import resume_safe_keys

SAVED_NAME = "config.yaml"  # the run's resolved request, written by rank 0 at set-up
# What a run may change and stay itself, but a sweep's cell may not: its members are pooled,
# so each trains exactly as long as the others.
LENGTH_KEYS = ("train.epochs", "train.max_steps")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(
    saved: dict, current: dict, also_safe: tuple[str, ...] = ()
) -> tuple[list[str], list[str]]:
    """(changes that alter the run, changes that keep it), each as 'key old -> new'; also_safe:
    the recipe's own keys that keep it (Recipe.resume_safe). A key on one side only is a
    field added or removed by a code update, at its default: not a change."""
    old, new = flatten(saved), flatten(current)
    safe_keys = resume_safe_keys() + also_safe  # declared beside each config field
    refused, allowed = [], []
    for key in sorted(old.keys() & new.keys()):
        if old[key] == new[key]:
            continue
        text = f"{key} {old[key]} -> {new[key]}"
        (allowed if key.startswith(safe_keys) else refused).append(text)
    return refused, allowed


def as_saved(config: dict) -> dict:
    """A config as its saved YAML reads back (tuples as lists), so a request compares equal
    to the config.yaml it would write (callers give it redacted, as that file is)."""
    return load_yaml(dump_yaml(config)) or {}


def request_changes(
    saved: dict, current: dict, also_safe: tuple[str, ...] = (), strict: tuple[str, ...] = ()
) -> list[str]:
    """The differences between a saved request and `current` that make it another request:
    every refused change, and an allowed one of a key in `strict`."""
    current = as_saved(current)
    asked = flatten(current)
    derived = [k for k, v in DERIVED_AT_START.items() if k in asked and asked[k] == v]
    refused, allowed = config_changes(as_saved(saved), current, also_safe)
    changes = refused + [c for c in allowed if c.split(" ", 1)[0] in strict]
    return [c for c in changes if c.split(" ", 1)[0] not in derived]  # set-up's to decide


def saved_request(path: Path) -> dict | None:
    """A saved request: a run's config.yaml, or a submission's frozen file; None for none
    (never started, or unreadable: then its checkpoints' own config decides at resume)."""
    try:
        data = load_yaml(path.read_text())
    except (OSError, UnicodeDecodeError, *YAML_FAILURES):
        return None
    return data if isinstance(data, dict) else None


def check_same_request(
    run_dir: Path, name: str, current: dict, also_safe: tuple[str, ...] = (), trained=True
) -> None:
    """Refuses, in one line, a request under `name` that is not the one the run in run_dir
    trained from. trained: whether the run there holds training (metrics or checkpoints);
    one that never trained may be started again with another request."""
    saved = saved_request(run_dir / SAVED_NAME) if trained else None
    if saved is None:
        return
    changes = request_changes(saved, current, also_safe)
    if changes:
        raise ConfigError(
            f"run.name={name} holds a run trained from another request ({', '.join(changes)}); "
            "one run name holds one request: go back to those values, or give this request "
            "another run.name"
        )
