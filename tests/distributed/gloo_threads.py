"""Run by test_clean_exit.py: the engine's command line in 2 spawned ranks, each of which
lists the gloo threads still alive in it once the engine has returned, in a file of its own
under $GLOO_THREADS_OUT (two ranks printing to one pipe can interleave their lines). A
process group that outlives the engine keeps them, and they end during interpreter shutdown
instead, where they sometimes abort a finished process (SIGABRT)."""

import os
import sys
import time

from engine.cli import main
from engine.spawn import spawn_local

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # their names in /proc (comm)
WAIT_S = 5.0


def gloo_threads() -> list[str]:
    names = (
        open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")
    )
    return sorted(name for name in names if name in GLOO_THREADS)


def counted(argv: list[str]) -> int:
    code = main(argv)
    # The group is destroyed inside the engine; its threads then end on their own, a moment
    # later on a busy machine (a CI run saw gloo_tcp_loop still listed right after main
    # returned, one run in many). A group the engine failed to destroy keeps them until
    # interpreter shutdown: still there after the wait.
    deadline = time.monotonic() + WAIT_S
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    rank = os.environ["RANK"]
    out = os.path.join(os.environ["GLOO_THREADS_OUT"], f"rank{rank}")
    with open(out, "w") as f:
        f.write(f"rank {rank} exit {code} gloo threads left: {gloo_threads()}\n")
    return code


if __name__ == "__main__":
    # gloo_threads.py RUN_NAME RECIPE [--eval PATH] -- KEY=VALUE...
    run_name, rest = sys.argv[1], sys.argv[2:]
    at = rest.index("--")
    sys.exit(spawn_local(2, counted, [*rest[:at], *rest[at + 1 :], f"run.name={run_name}"]))
