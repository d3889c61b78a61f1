"""Stopping on a signal: the handler only sets a flag; the loop acts on it at the next step
where ranks agree anyway (a collective at log intervals), saves one checkpoint together with
the other ranks and exits with EXIT_PREEMPTED.

SIGUSR2: SLURM's warning ahead of the time limit (sbatch --signal=USR2@lead). SIGTERM: scancel,
preemption, torchrun or a container stopping. SIGINT: Ctrl-C; a second Ctrl-C exits at once
(the last complete checkpoint stays, the one being written is never chosen)."""

from __future__ import annotations

import os
import signal

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpoint saved; rerun the same command to resume
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)

INTERRUPT_NOTICE = (
    b"interrupt: stopping at the next agreed step after a checkpoint; "
    b"press Ctrl-C again to exit at once\n"
)

_requested: list[str] = []


def request_stop(reason: str = "requested") -> None:
    """Safe to call from a signal handler: it only records the request."""
    _requested.append(reason)


def stop_requested() -> bool:
    return bool(_requested)


def received() -> list[str]:
    """What asked this process to stop, first to last, without repeats."""
    return list(dict.fromkeys(_requested))


def reset() -> None:
    _requested.clear()


def _on_signal(signum, frame) -> None:
    name = signal.Signals(signum).name
    if name == "SIGINT" and "SIGINT" in _requested:
        os.write(2, b"second interrupt: exiting now, without a checkpoint for this step\n")
        os._exit(EXIT_INTERRUPTED)
    if name == "SIGINT":
        os.write(2, INTERRUPT_NOTICE)  # not print(): a handler may interrupt a print
    request_stop(name)


def finished() -> None:
    """The run is over: a time-limit warning (SIGUSR2) has nothing left to save. Ignored from
    here on, because Python puts its own handlers back to the default action while it shuts
    down, and USR2's default action ends the process: a warning in those last moments made a
    finished SLURM job FAILED (exit 140). SIGTERM keeps its meaning (end now)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def install_handlers(signals=STOP_SIGNALS) -> None:
    for sig in signals:
        signal.signal(sig, _on_signal)
