"""Shared memory for loader workers, estimated before they start.

Each DataLoader worker hands its batches to the training process through /dev/shm; up to
num_workers x prefetch_factor batches per process wait there. A container's default /dev/shm
(64 MiB in docker) is far smaller than that for 224 px images, and overrunning it ends the
run in a bus error inside a worker, with no word about the cause. One sample is loaded to
size a batch, and the node's total is set against what /dev/shm has free."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch
from torch.utils.data import Dataset

from engine.config import LoaderConfig

SHM = Path("/dev/shm")
GIB = 2**30


def tensor_bytes(value) -> int:
    """Bytes of every tensor in a sample (nested in tuples, lists, dicts or dataclasses)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def sample_bytes(samples: Dataset) -> int | None:
    """One sample's bytes as the workers would send it; None when it cannot be loaded here
    (the loader then names the problem itself). `samples` takes (index, seed, epoch) keys and
    restores the caller's RNG state, so loading it changes nothing of the run."""
    try:
        return tensor_bytes(samples.__getitems__([(0, 0, 0)])[0].x)
    except Exception:  # noqa: BLE001 - an estimate only: the real load reports any error
        return None


def free_bytes(path: Path = SHM) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:  # no /dev/shm (not Linux): nothing to check
        return None


def warning(need: int, free: int, parts: str) -> str | None:
    """The warning for an estimate above what is free, or None."""
    if need <= free:
        return None
    size = max(1, -(-2 * need // GIB))  # twice the estimate, in whole GiB
    return (
        f"warning: the loader workers may hold ~{need / GIB:.1f} GiB in {SHM} ({parts}), "
        f"more than the {free / GIB:.1f} GiB free there; a bus error would end the run. Start "
        f"the container with --ipc=host or --shm-size={size}g, or lower loader.num_workers or "
        "loader.prefetch_factor"
    )


def check(samples: Dataset, batch: int, cfg: LoaderConfig, processes: int) -> str | None:
    """The warning for this node's loaders (`processes` training processes on it), if any."""
    if cfg.num_workers == 0:
        return None
    free = free_bytes()
    one = sample_bytes(samples) if free is not None else None
    if not one:
        return None
    waiting = cfg.num_workers * cfg.prefetch_factor
    need = processes * waiting * batch * one
    parts = (
        f"{processes} process(es) x {cfg.num_workers} workers x {cfg.prefetch_factor} "
        f"prefetched x {batch} samples x {one / 2**20:.2f} MiB"
    )
    return warning(need, free, parts)


def processes_on_node(env=None) -> int:
    """Training processes on this node: torchrun's and spawn's LOCAL_WORLD_SIZE, SLURM's
    tasks per node ("4" or "4(x2)"), else 1."""
    env = os.environ if env is None else env
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        text = env.get(name, "").split("(")[0].split(",")[0]
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1
