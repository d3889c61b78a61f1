"""Repeat the shortest 2-process run (torchrun, gloo, digits, DDP, 2 steps and a checkpoint)
and count the runs that did not exit cleanly: a non-zero exit of torchrun or a rank, or a
C++ abort message ("terminate called") after the run. Not part of `make test` (it costs
minutes); the README's reliability table quotes its result.

    .venv/bin/python tests/distributed/repeat_exit.py [RUNS]   (default 50)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import QUIET, REPO, engine_env, torchrun  # noqa: E402

RUN = ["model.norm=group", "train.max_steps=2", "ckpt.every_steps=1", "train.micro_batch_size=16"]


def one_run(root: Path, i: int) -> str | None:
    """None for a clean exit, else what went wrong."""
    cmd = [*torchrun(2), "digits", *QUIET, f"run.root={root}", f"run.name=r{i}", *RUN]
    out = subprocess.run(
        cmd, cwd=REPO, env=engine_env(), capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0 or "terminate called" in out.stderr:
        return f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"
    shutil.rmtree(root / "digits" / f"r{i}")
    return None


def main(runs: int) -> int:
    started, failures = time.time(), []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            if (failure := one_run(Path(tmp), i)) is not None:
                failures.append(failure)
                print(f"run {i}: {failure}", flush=True)
    print(f"{runs} runs, {len(failures)} unclean exits, {time.time() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 50))
