"""torchrun as launch starts it: `python -m engine.torchrun ARGS` takes torchrun's own
arguments and runs torch.distributed.run's main, unchanged, in this process.

What differs is the end of a failed run. torchrun ends it with ChildFailedError's traceback
and its "Root Cause" table, printed after the failing rank's own one-line error (a hung
rank named with its step, a config refused) and burying it. Here it is one line naming the
first worker that failed, and the exit code is that worker's (75: stopped with a checkpoint,
2: a bad request; 1 for a worker killed by a signal), as for a single process."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode
        how = f"exited with code {code}" if code > 0 else f"was killed by {failure.signal_name()}"
        print(
            f"torchrun: worker rank {rank} (pid {failure.pid}) {how} first; its own lines "
            "above say why",
            file=sys.stderr,
            flush=True,
        )
        return code if 0 < code < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
