"""Checkpoints: written atomically, loaded with weights_only=True, free of wrapper prefixes.

A checkpoint is either one file `step-<n>.pt` holding the bare model, optimizer, scheduler
and scaler states, the position in training (epoch, step, samples into the epoch) and every
rank's RNG states, written by rank 0 alone; or a directory `step-<n>/` (engine.checkpoint.
sharded) where every rank writes its shards of the model and optimizer states with
torch.distributed.checkpoint, and rank 0 the rest as `meta.pt`. Both kinds are listed,
pruned and checked for completeness here; engine.export turns either into a plain file."""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
NAME = re.compile(r"step-(\d+)\.pt$")  # a single-file checkpoint
SHARDED_NAME = re.compile(r"^step-(\d+)$")  # a sharded checkpoint's directory


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


def atomic_save(obj: Any, path: Path, pause_s: float = 0.0) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the target, so a
    crash leaves either the old file or the complete new one, never a torn file. pause_s
    stalls halfway through the bytes (fault tests: a process killed mid-write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if pause_s:
                _write_with_pause(obj, f, pause_s)
            else:
                _save_reporting_os_errors(obj, f)
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


class _WriteRecorder:
    """torch.save's zip writer turns a failed write (a full disk) into a RuntimeError about
    stream positions; this keeps the OSError so the error can say what really happened."""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def _save_reporting_os_errors(obj: Any, f) -> None:
    recorder = _WriteRecorder(f)
    try:
        torch.save(obj, recorder)
    except RuntimeError:
        if recorder.error is not None:
            raise recorder.error from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """A small file replaced whole or not at all (a full disk keeps the old one)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_with_pause(obj: Any, f, pause_s: float) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    time.sleep(pause_s)
    f.write(data[len(data) // 2 :])


def checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}.pt"


def sharded_path(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}"


def _match(path: Path) -> re.Match | None:
    return SHARDED_NAME.search(path.name) if path.is_dir() else NAME.search(path.name)


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in the folder, files and directories alike, newest (highest step) first.
    A sharded checkpoint still being written is a hidden `.step-<n>.partial`: never listed."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p.name, p) for p in folder.iterdir() if (m := _match(p))]
    return [p for _, _, p in sorted(found, reverse=True)]


def step_of(path: Path) -> int:
    return int((NAME.search(path.name) or SHARDED_NAME.search(path.name)).group(1))


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
    from engine.checkpoint import sharded

    aside = sharded.old_path(path)
    if aside.exists():
        shutil.rmtree(aside)
    path.rename(aside)
    shutil.rmtree(aside)


def load(path: Path) -> dict[str, Any]:
    """A file checkpoint's whole state, or a sharded checkpoint's meta dict (its model and
    optimizer states are loaded into live objects by sharded.load)."""
    try:
        if path.is_dir():
            from engine.checkpoint import sharded

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
    from engine.checkpoint import sharded

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
            failures.append(f"{path.name}: {_reason(err)}")
            print(
                f"warning: skipping unreadable checkpoint {path}: {_reason(err)}", file=sys.stderr
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


def _reason(err: Exception) -> str:
    text = " ".join(str(err).split())
    first = text.split(". ")[0][:160]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


# A resumed run may change these and stay the same run: how it is logged, evaluated,
# checkpointed, loaded and spread over processes, and how long it goes on. Anything else
# (seed, batch, optimizer, schedule, model, data, augmentation) would change what it trains.
SAFE_TO_CHANGE = (
    "run.",
    "log.",
    "ckpt.",
    "eval.",
    "slurm.",
    "fault.",
    "dist.",
    "loader.num_workers",
    "loader.pin_memory",
    "loader.persistent_workers",
    "loader.prefetch_factor",
    "train.epochs",
    "train.max_steps",
    "train.stop_at_step",
    "train.micro_batch_size",
    "train.compile",
    "train.channels_last",
    "train.activation_checkpointing",
    "train.tf32",
    "train.cudnn_benchmark",
    "optim.implementation",
    "train.nan_policy",
    "data.root",
    "data.download",
    "device",
    "resume",
    "deterministic",
    "variant",
)
GUARDED = ("dist.sync_bn",)  # batch statistics over all ranks: another computation


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(changes that alter the run, changes that keep it), each as 'key old -> new'. A key on
    one side only is a field added or removed by a code update, at its default: not a change."""
    old, new = flatten(saved), flatten(current)
    refused, allowed = [], []
    for key in sorted(old.keys() & new.keys()):
        if old[key] == new[key]:
            continue
        text = f"{key} {old[key]} -> {new[key]}"
        safe = key.startswith(SAFE_TO_CHANGE) and not key.startswith(GUARDED)
        (allowed if safe else refused).append(text)
    return refused, allowed
