"""Failures the run reports in one line, and the deliberate ones the fault tests inject.

RunError: the run cannot go on (disk full, non-finite gradients, a peer that stopped
answering); the message says what happened, what is intact and how to continue. It is not a
user's config mistake (ConfigError, exit 2), so the exit code is 1."""

from __future__ import annotations

import os
import signal
import time

from engine.config import FaultConfig


class RunError(RuntimeError):
    """Training stopped for a reason the message states; printed as one line, exit 1."""


class InjectedFault(RuntimeError):
    pass


def first_attempt() -> bool:
    """False in a group torchrun restarted, so an injected crash happens once, not forever."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def inject_after_step(cfg: FaultConfig, step: int, rank: int) -> None:
    """The faults that strike after an optimizer step, on cfg.rank only."""
    if rank != cfg.rank or step not in (cfg.raise_at_step, cfg.signal_at_step, cfg.hang_at_step):
        return  # every step passes here: no environment read unless a fault is due
    if cfg.raise_at_step == step:
        raise InjectedFault(f"injected fault at step {step} on rank {rank}")
    if not first_attempt():
        return
    if cfg.signal_at_step == step:
        os.kill(os.getpid(), getattr(signal, cfg.signal))
    if cfg.hang_at_step == step:
        while True:  # a rank stuck in a step: it answers no collective, and no signal ends it
            time.sleep(3600)


def slow_data(cfg: FaultConfig) -> None:
    """Stall each fetch of a batch, as data on slow storage does (starvation diagnostics)."""
    if cfg.data_delay_ms:
        time.sleep(cfg.data_delay_ms / 1000)


def save_pause(cfg: FaultConfig, step: int) -> float:
    """Seconds to stall mid-write of this step's checkpoint (a slow or dying filesystem)."""
    return 3600.0 if cfg.hang_in_save_at_step == step and first_attempt() else 0.0
