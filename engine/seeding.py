"""Seeds and RNG state. One config seed; per-rank and per-sample seeds are derived from it."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of its integer parts (SplitMix64 mixing)."""
    x = 0x9E3779B97F4A7C15
    for part in parts:
        x = (x ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x >> 1


def seed_process(seed: int, rank: int) -> None:
    """Seed python, numpy and torch for this process, from the global rank (never local)."""
    s = derive_seed(seed, rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def set_deterministic(enabled: bool) -> None:
    if not enabled:
        return
    # cuBLAS needs a fixed workspace for deterministic GEMMs; set before the first CUDA call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def seed_sample(sample_seed: int, python_numpy: bool = False) -> None:
    """Make per-sample randomness (augmentation) a function of (seed, epoch, index) alone, so
    it does not change with num_workers, world size, or a mid-epoch resume.

    torch's RNG always (torchvision's transforms draw from it); python's and numpy's only when
    asked (loader.seed_python_numpy), since seeding them costs more than a small sample."""
    torch.default_generator.manual_seed(sample_seed)  # CPU only: torch.manual_seed costs 100x
    if python_numpy:
        random.seed(sample_seed)
        np.random.seed(sample_seed % 2**32)


def worker_init(worker_id: int) -> None:
    # Per-sample seeding does the real work; this keeps stray RNG use in workers distinct.
    info = torch.utils.data.get_worker_info()
    seed_sample(derive_seed(info.seed if info else 0, worker_id), python_numpy=True)


def rng_state() -> dict:
    """This process's RNG states, in types that torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
