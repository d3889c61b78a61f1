"""Start N local processes without torchrun (notebooks, machines without it).

Each child gets the variables torchrun would set, so it runs exactly the torchrun path,
including its store: the parent hosts the rendezvous store, as torchrun's agent does."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now (for tests that need one to pass on; it can be taken before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(local_rank: int, world: int, port: int, argv: list[str], threads: int, entry) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent's store (host_store)
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    try:
        code = entry(argv)
    except Exception as err:
        # torch reports the first process it finds dead, often a peer that lost its
        # connection; every failing rank says its own cause, so the real one is never hidden.
        cause = (str(err).strip().splitlines() or [""])[-1]
        print(
            f"rank {local_rank} failed: {type(err).__name__}: {cause}", file=sys.stderr, flush=True
        )
        raise
    if code:
        raise SystemExit(code)


def _pass_signals_on(ctx) -> None:
    """SIGTERM and SIGUSR2 sent to this parent reach every child, which checkpoints and stops.
    Ctrl-C already reaches them (the terminal signals the whole process group): the parent
    only waits for them, instead of dying first with a KeyboardInterrupt."""

    def forward(signum, frame):
        if signum == signal.SIGINT:
            return
        for process in ctx.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, forward)


# What every child imports before its first step, imported once in the fork server instead
# of once per child (~4 s of CPU each): torch.optim imports torch._dynamo on its first
# parameter group, the image recipes torchvision. A module that is missing is skipped.
PRELOAD = ("torch", "torch._dynamo", "torchvision")


def host_store(world: int) -> dist.TCPStore:
    """The rendezvous store, hosted by this process on a port the OS picks and that stays
    bound: a port chosen free and then bound by rank 0 seconds later (after the fork server's
    imports) could be taken in between by another program's socket, failing the run."""
    timeout = datetime.timedelta(minutes=30)  # the clients' own timeouts govern the run
    return dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False
    )


def spawn_local(n: int, entry: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run entry(argv) (the engine's command line) in n processes. The parent picks the port
    (and, in argv, the run name) so every child agrees on them.

    The children fork from a fork server, a fresh interpreter that has imported PRELOAD and
    the entry's module: nothing of this process (threads, OpenMP's pool, CUDA) is forked,
    as with "spawn", and the imports are paid once per run, not once per process."""
    threads = max(1, (os.cpu_count() or 1) // n)
    home = entry.__module__
    mp.set_forkserver_preload([*PRELOAD, *([home] if home != "__main__" else [])])
    store = host_store(n)  # held until every child has ended
    ctx = mp.start_processes(
        _child,
        args=(n, store.port, argv, threads, entry),
        nprocs=n,
        join=False,
        start_method="forkserver",
    )
    _pass_signals_on(ctx)
    try:
        # When one child fails, the others get 5 s to end on their own (a lost peer ends them)
        # before SIGTERM, then 5 s more before SIGKILL (a hung rank answers no signal).
        while not ctx.join(grace_period=5):
            pass
    except mp.ProcessExitedException as err:
        return err.exit_code if err.exit_code and err.exit_code > 0 else 1
    except mp.ProcessRaisedException as err:
        print(str(err).strip().splitlines()[-1])
        return 1
    return 0
