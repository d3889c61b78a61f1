"""Sharded checkpoints: a directory `step-<n>/` that every rank writes its part of.

The model and optimizer states go through torch.distributed.checkpoint (DCP): each rank
writes the shards it holds (DTensor shards under FSDP, whole tensors otherwise) and DCP's
`.metadata` records the global shapes, so a checkpoint written by N processes loads on M,
or on one process with a plain model. Everything else (position in training, every rank's
RNG states, scheduler and scaler states, the config) is the caller's `meta` dict, written by
rank 0 as `meta.pt` with the single-file checkpoint's atomic_save.

A checkpoint counts only once complete: the ranks write into `.step-<n>.partial` beside
it, and rank 0 renames that to `step-<n>` after every rank has finished. A writer killed
half way leaves the `.partial` directory, which list_checkpoints never returns and
rundir.remove_partial_checkpoints clears.

save and load are collectives when a process group is initialised (every rank calls
them) and work in one process without one.

BackgroundWriter (ckpt.async_save) splits save in two: start copies this rank's shards into
CPU memory, writes meta.pt and returns, while a thread writes the copy (DCP's async_save);
finish, called before the next save and at the end of training, waits for that write and
publishes the checkpoint by the same rename. close, on the way out after an error, waits
for it and lets rank 0 publish it if it completed, with no collective. A failure on any rank reaches every rank
together: an OSError (full disk, permissions) is raised on every rank as the same OSError
whose strerror names the reason and the rank, so the caller can print one line and no rank
is left waiting at a barrier."""

from __future__ import annotations

import datetime
import errno
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from engine.atomic import atomic_save, fsync_dir
from engine.checkpoint.files import old_path, partial_path
from engine.config import ConfigError
from engine.distributed import gather_objects

META = "meta.pt"
DCP_METADATA = ".metadata"


class SaveFailed(RuntimeError):
    """A save failed on some rank for a reason other than the disk's (raised on every rank)."""


def is_sharded(path: Path) -> bool:
    return Path(path).is_dir()


# ---------------------------------------------------------------- saving


def save(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict, pause_s: float = 0.0
) -> None:
    """Write the checkpoint directory `path` (a collective under a process group). The
    optimizer must hold state (save after a step): DCP's get_state_dict would otherwise
    initialise it with a zero-lr step, which changes a live AdamW's step count."""
    path = Path(path)
    partial = partial_path(path)
    main = _rank() == 0
    _together(lambda: main and _fresh_dir(partial), "preparing")
    model_state, optim_state = get_state_dict(model, optimizer)
    _together(
        lambda: _dcp(dcp.save, {"model": model_state, "optimizer": optim_state}, partial),
        "writing the shards",
    )
    _together(lambda: main and atomic_save(meta, partial / META), "writing meta.pt")
    if pause_s:
        time.sleep(pause_s)  # fault tests kill the process here: shards written, not renamed
    _together(lambda: main and _publish(partial, path), "renaming")


@dataclass
class Writing:
    """A checkpoint whose shards a background thread is writing into its partial directory."""

    path: Path
    future: Future
    pause_s: float  # fault tests stall here, before the rename


class BackgroundWriter:
    """Sharded checkpoints written while training goes on (ckpt.async_save). One at a time:
    start refuses while one is being written (finish it first). Created on every rank
    alike: under a process group, its creation is a collective."""

    def __init__(self, timeout_s: float):
        # A gloo group of the writer's own: DCP's collectives in the writing thread would
        # otherwise share the default group with training's, interleaved in another order on
        # each rank. gloo also on GPUs: async_save needs a CPU backend for its staged copy.
        timeout = datetime.timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if _distributed() else None
        self.writing: Writing | None = None
        if self.group is None:  # DCP's note that it assumes one process, said in the thread
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def start(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        meta: dict,
        pause_s: float = 0.0,
    ) -> None:
        """A collective: every rank copies its shards into CPU memory (training may change
        the live ones from here on) and hands them to a thread that writes them; rank 0
        writes meta.pt. Returns once the copy is made; failures so far are raised as save's."""
        if self.writing is not None:
            raise RuntimeError(f"{self.writing.path} is still being written; finish it first")
        path, main = Path(path), _rank() == 0
        partial = partial_path(path)
        _together(lambda: main and _fresh_dir(partial), "preparing")
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}

        def begin() -> None:  # kept even if another rank failed: close() waits for it
            self.writing = Writing(path, self._async_save(state, partial), pause_s)

        _together(begin, "copying the shards")
        _together(lambda: main and atomic_save(meta, partial / META), "writing meta.pt")

    def _async_save(self, state: dict, partial: Path) -> Future:
        no_dist = self.group is None
        return dcp.async_save(
            state, checkpoint_id=partial, process_group=self.group, no_dist=no_dist
        )

    def finish(self) -> Path | None:
        """A collective: wait for the checkpoint being written, then publish it (rank 0's
        rename, agreed by every rank). A failed write on any rank is raised on every rank as
        save raises it. Returns the published checkpoint, None when none was being written."""
        writing, self.writing = self.writing, None
        if writing is None:
            return None
        _together(writing.future.result, "writing the shards")
        if writing.pause_s:
            time.sleep(writing.pause_s)  # fault tests kill the process here
        partial, main = partial_path(writing.path), _rank() == 0
        _together(lambda: main and _publish(partial, writing.path), "renaming")
        return writing.path

    def close(self) -> None:
        """After an error, with no collective (the other ranks may be gone or elsewhere):
        wait for the write, and on rank 0 publish it if it completed. DCP's save returns on
        rank 0 only once every rank's shards and the index are written, and meta.pt was
        written before start returned. A failed write leaves its partial directory, which
        the next start clears."""
        writing, self.writing = self.writing, None
        if writing is None:
            return
        try:
            writing.future.result()
        except Exception:  # the error that ends the run is already on its way
            return
        partial = partial_path(writing.path)
        if _rank() == 0 and (partial / META).is_file():
            _publish(partial, writing.path)


def _fresh_dir(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def _publish(partial: Path, path: Path) -> None:
    """The rename that makes the checkpoint count. The same step written again (a rerun
    from an older checkpoint) replaces the old directory only once the new one is complete."""
    old = old_path(path)
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        path.rename(old)
    partial.rename(path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _together(action: Callable[[], Any], doing: str) -> None:
    """action() on this rank, then every rank learns whether any rank failed (this is also
    the barrier between the steps of a save). The failure is raised on every rank alike:
    an OSError as an OSError whose strerror says which rank failed at what and why."""
    failure = None
    try:
        action()
    except CheckpointException as err:  # DCP gathered every rank's failure for each rank
        failure = _first_failure(err)
    except Exception as err:  # any failure must reach the other ranks, not only OSError
        failure = _describe(err, _rank())
        if not isinstance(err, OSError):
            gather_objects(failure)
            raise
    failures = [f for f in gather_objects(failure) if f is not None]
    if failures:
        code, rank, reason = failures[0]
        message = f"{reason} (rank {rank}, {doing})"
        if code is None:
            raise SaveFailed(f"saving the sharded checkpoint failed: {message}")
        raise OSError(code, message)


def _describe(err: BaseException, rank: int) -> tuple[int | None, int, str]:
    """(errno or None, rank, one-line reason) of a failure, picklable for the other ranks."""
    if isinstance(err, OSError):
        reason = err.strerror or str(err) or type(err).__name__
        if err.filename:
            reason += f": {Path(err.filename).name}"
        return err.errno or errno.EIO, rank, reason
    text = " ".join(str(err).split())[:200]
    return None, rank, f"{type(err).__name__}: {text}" if text else type(err).__name__


def _first_failure(err: CheckpointException) -> tuple[int | None, int, str]:
    failures = sorted(err.failures.items())
    for rank, (exc, _) in failures:  # an OSError says the most to the user
        if isinstance(exc, OSError):
            return _describe(exc, rank)
    rank, (exc, _) = failures[0] if failures else (0, (err, None))
    return _describe(exc, rank)


def _dcp(function, state: dict, path: Path, no_dist: bool | None = None):
    """dcp.save or dcp.load, without a process group in one process (no_dist), where DCP's
    warning that it then assumes a single process says nothing worth reading."""
    no_dist = not _distributed() if no_dist is None else no_dist
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return function(state, checkpoint_id=path, no_dist=no_dist)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


# ---------------------------------------------------------------- loading


def read_meta(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / META, map_location="cpu", weights_only=True)


def read_metadata(path: Path):
    """DCP's index of the checkpoint: every saved key with its global size and dtype."""
    return FileSystemReader(str(path)).read_metadata()


def load(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load the model (and optimizer) states into the live objects, however they are
    sharded now, and return the meta dict. A collective under a process group. A checkpoint
    that does not fit the model (or optimizer) is a ConfigError in one line."""
    path = Path(path)
    optimizers = [optimizer] if optimizer is not None else []
    model_state, optim_state = get_state_dict(model, optimizers)
    meta = _agreed_config(lambda: _read_checked(path, model_state))
    state = {"model": model_state} | ({"optimizer": optim_state} if optimizer else {})
    try:
        _dcp(dcp.load, state, path)
    except CheckpointException as err:  # raised on every rank alike
        _, _, reason = _first_failure(err)
        raise ConfigError(
            f"checkpoint {path} does not fit this model or optimizer ({reason})"
        ) from None
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optimizer", {}),
    )
    return meta


def _read_checked(path: Path, model_state: dict[str, Any]) -> dict[str, Any]:
    """The meta dict, after checking that the saved model keys and shapes are the model's."""
    if not (path / DCP_METADATA).is_file() or not (path / META).is_file():
        raise ConfigError(
            f"{path} is not a complete sharded checkpoint (no {DCP_METADATA} or {META}); "
            "check resume=<path>"
        )
    saved = {k: tuple(item.size) for k, item in _model_items(read_metadata(path)).items()}
    wanted = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    missing = sorted(wanted.keys() - saved.keys())
    unexpected = sorted(saved.keys() - wanted.keys())
    shapes = [
        f"{k}: saved {list(saved[k])}, model {list(wanted[k])}"
        for k in sorted(wanted.keys() & saved.keys())
        if saved[k] != wanted[k]
    ]
    problems = [
        f"{label} {', '.join(items[:3])}{', ...' if len(items) > 3 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", shapes))
        if items
    ]
    if problems:
        raise ConfigError(
            f"checkpoint {path} does not fit this model ({'; '.join(problems)}); resume with "
            "the config that wrote it, or start a new run (resume=none or another run.name)"
        )
    return read_meta(path)


def _model_items(metadata) -> dict[str, TensorStorageMetadata]:
    """The saved model tensors' global size and dtype, by name (no `model.` prefix)."""
    return {
        key[len("model.") :]: item
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }


def _agreed_config(action: Callable[[], Any]) -> Any:
    """action() on every rank; a ConfigError on any rank is raised on every rank."""
    result, error = None, None
    try:
        result = action()
    except ConfigError as err:
        error = str(err)
    errors = [e for e in gather_objects(error) if e is not None]
    if errors:
        raise ConfigError(errors[0])
    return result


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The whole model state of a sharded checkpoint, unsharded, in this process (no model,
    no process group): CPU tensors named as in the model (no `model.` prefix)."""
    templates = {
        name: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for name, item in _model_items(read_metadata(path)).items()
    }
    state = {"model": templates}
    _dcp(dcp.load, state, Path(path), no_dist=True)
    return state["model"]
