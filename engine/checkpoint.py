"""Checkpoints: written atomically, loaded with weights_only=True, free of wrapper prefixes.

A checkpoint is one file `step-<n>.pt` holding the bare model, optimizer, scheduler and
scaler states, the position in training (epoch, step, samples into the epoch) and every
rank's RNG states. Only rank 0 writes."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
NAME = re.compile(r"step-(\d+)\.pt$")


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DataParallel/DDP/FSDP-style `.module` and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def strip_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """Drop `module.` / `_orig_mod.` prefixes written by DP, DDP or compiled models."""
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
        out[key] = value
    return out


def load_model_state(model: nn.Module, state: dict[str, Any], source: Path | None = None) -> None:
    try:
        unwrap(model).load_state_dict(strip_prefixes(state))
    except RuntimeError as err:  # another model or config: a user mistake, said in one line
        detail = " ".join(str(err).split())[:300]
        raise ConfigError(
            f"checkpoint {source or ''} does not fit this model ({detail}); resume with the "
            "config that wrote it, or start a new run (resume=none or another run.name)"
        ) from None


def atomic_save(obj: Any, path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the target, so a
    crash leaves either the old file or the complete new one, never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}.pt"


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in the folder, newest (highest step) first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.search(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def prune(folder: Path, keep: int) -> None:
    for old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {path} does not exist; check resume=<path>") from None


def latest_valid(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; a torn or corrupt file is skipped with a warning."""
    for path in list_checkpoints(folder):
        try:
            return path, torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a torn file from a crash: fall back to the previous one
            print(f"warning: skipping unreadable checkpoint {path}: {type(err).__name__}")
    return None
