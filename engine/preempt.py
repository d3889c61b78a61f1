"""Preemption: a signal only sets a flag; the loop acts on it at the next step boundary,
where all ranks agree (a collective), save one checkpoint together and stop.

SLURM sends SIGUSR2 ahead of the time limit (sbatch --signal=USR2@lead)."""

from __future__ import annotations

import signal

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpoint saved; rerun the same command to resume

_requested: list[str] = []


def request_stop(reason: str = "requested") -> None:
    """Safe to call from a signal handler: it only records the request."""
    _requested.append(reason)


def stop_requested() -> bool:
    return bool(_requested)


def reset() -> None:
    _requested.clear()


def _on_signal(signum, frame) -> None:
    request_stop(signal.Signals(signum).name)


def install_handlers(signals=(signal.SIGUSR2,)) -> None:
    for sig in signals:
        signal.signal(sig, _on_signal)
