"""Checkpoints: written atomically, loaded with weights_only=True, free of wrapper prefixes.

A checkpoint is either one file `step-<n>.pt` holding the bare model, optimizer, scheduler
and scaler states, the position in training (epoch, step, samples into the epoch) and every
rank's RNG states, written by rank 0 alone; or a directory `step-<n>/` (engine.checkpoint.
sharded) where every rank writes its shards of the model and optimizer states with
torch.distributed.checkpoint, and rank 0 the rest as `meta.pt`. Both kinds are listed,
pruned and checked for completeness here; engine.export turns either into a plain file.
The best ones by the headline metric are also kept in the run's best/ (engine.checkpoint.best)."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Atomic writes and the files' names, used through this package (`ckpt.atomic_save`).
from engine.atomic import atomic_save as atomic_save
from engine.atomic import atomic_write_text as atomic_write_text
from engine.checkpoint.files import checkpoint_path as checkpoint_path
from engine.checkpoint.files import list_checkpoints as list_checkpoints
from engine.checkpoint.files import old_path
from engine.checkpoint.files import sharded_path as sharded_path
from engine.checkpoint.files import step_of as step_of
from engine.config import ConfigError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


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


def prune(folder: Path, keep: int, written: Path) -> None:
    """Keep the checkpoint just written and the newest others up to `keep` in all. Files of a
    higher step (unreadable ones a resumed run skipped) are left for the run to overwrite."""
    older = [p for p in list_checkpoints(folder) if step_of(p) < step_of(written)]
    for old in older[max(keep - 1, 0) :]:
        if old.is_dir():
            _remove_dir(old)
        else:
            old.unlink(missing_ok=True)


def _remove_dir(path: Path) -> None:
    """A sharded checkpoint leaves the listing at once (renamed to a hidden name that
    rundir.remove_partial_checkpoints clears if this is interrupted), then is deleted."""
    aside = old_path(path)
    if aside.exists():
        shutil.rmtree(aside)
    path.rename(aside)
    shutil.rmtree(aside)


def load(path: Path) -> dict[str, Any]:
    """A file checkpoint's whole state, or a sharded checkpoint's meta dict (its model and
    optimizer states are loaded into live objects by sharded.load)."""
    try:
        if path.is_dir():
            from engine.checkpoint import sharded  # start-up time: imports DCP

            return sharded.read_meta(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        if path.is_dir():
            raise ConfigError(
                f"checkpoint {path} is not complete (no meta.pt); check resume=<path>"
            ) from None
        raise ConfigError(f"checkpoint {path} does not exist; check resume=<path>") from None


def _read(path: Path) -> dict[str, Any]:
    """What latest_valid accepts: a file that loads; a directory whose meta.pt loads and
    whose DCP index (.metadata) reads."""
    if not path.is_dir():
        return torch.load(path, map_location="cpu", weights_only=True)
    from engine.checkpoint import sharded  # start-up time: imports DCP

    sharded.read_metadata(path)
    return sharded.read_meta(path)


def latest_valid(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads. A torn or corrupt newer file (or a sharded directory
    without a readable meta.pt or .metadata) is skipped with a warning; when checkpoints exist
    but none loads, training must not start from step 0 (and then prune the run's own
    history away): that is a one-line error. For a directory, the state is its meta dict."""
    failures = []
    for path in list_checkpoints(folder):
        try:
            state = _read(path)
        except Exception as err:  # torn by a crash, tampered, or from an incompatible version
            failures.append(f"{path.name}: {reason(err, path)}")
            print(
                f"warning: skipping unreadable checkpoint {path}: {reason(err, path)}",
                file=sys.stderr,
            )
            continue
        return path, state
    if failures:
        raise ConfigError(
            f"no checkpoint in {folder} loads ({'; '.join(failures[:3])}"
            f"{'; ...' if len(failures) > 3 else ''}); move them aside to start afresh, or "
            "launch with another run.name (or resume=none run.overwrite=true)"
        )
    return None


# What reading a file cut short raises: unpickling a stream that ends early (EOFError, and
# IndexError "pop from empty list" from pickle's stack), or a zip with no directory at its end.
CUT_SHORT = (EOFError, IndexError)


def reason(err: Exception, path: Path | None = None) -> str:
    """Why a checkpoint does not load, in a few words: "truncated: not a checkpoint" for a
    file cut short (a crash while writing, a full disk, a partial copy), else the error."""
    if path is not None and path.is_file() and not zipfile.is_zipfile(path):
        size = path.stat().st_size
        return f"truncated: not a checkpoint ({size} bytes, no zip directory at its end)"
    if isinstance(err, CUT_SHORT):
        return f"truncated: not a checkpoint ({type(err).__name__} reading it)"
    text = " ".join(str(err).split())
    first = text.split(". ")[0][:160]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__
