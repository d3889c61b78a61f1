"""The last step of a sharded checkpoint save, the rename of `.step-<n>.partial` into place
on rank 0, is agreed by every rank (engine.checkpoint.sharded: `_publish` run inside
`_together`): no rank returns from save before the checkpoint is published, and a rename
that fails on rank 0 fails the save on every rank.

Two real gloo processes on CPU; this file runs itself as a script, the two cases
(`slow-rename`, then `failed-rename`) one after the other, and in each rank 0 patches its
own rename of the partial directory. Each rank writes what it saw the moment save ended;
the parent checks both. The process group's timeout is short, so a rank left waiting fails
instead of hanging."""

from __future__ import annotations

import datetime
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.spawn import free_port
from tests.helpers import engine_env

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]
STEP = 3
RENAME_DELAY_S = 3.0  # rank 0 holds the rename this long; a rank not waiting looks meanwhile
GROUP_TIMEOUT_S = 30
CASES = ("slow-rename", "failed-rename")  # in this order, in the same two processes

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def run_cases(folder: Path) -> dict[str, list[dict]]:
    """Both cases, one after the other in one pair of processes: what each rank saw in each."""
    port, env = free_port(), engine_env()
    out = subprocess.run(
        [sys.executable, str(HERE), str(folder), str(port)],
        capture_output=True,
        text=True,
        timeout=3 * GROUP_TIMEOUT_S + 60,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return {
        case: [json.loads((folder / case / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
        for case in CASES
    }


def test_no_rank_returns_before_rank_0_has_published_and_a_failed_rename_fails_every_rank(
    tmp_path,
):
    cases = run_cases(tmp_path)

    # slow-rename: no rank returns from save before rank 0 has published the checkpoint
    ranks = cases["slow-rename"]
    for rank, seen in enumerate(ranks):
        assert seen["error"] is None, (rank, seen)
        assert seen["renames_held"] == (1 if rank == 0 else 0), (rank, seen)
        # the moment save returned, the step directory was in place, complete, listed
        assert seen["published"], (rank, seen)
        assert seen["listed"] == [f"step-{STEP:08d}"], (rank, seen)
        assert seen["partial_left"] is False, (rank, seen)
        assert seen["meta_step"] == STEP, (rank, seen)

    # failed-rename: a rename that fails on rank 0 fails the save on every rank
    ranks = cases["failed-rename"]
    assert ranks[0]["renames_held"] == 1
    for rank in (1, 0):
        seen = ranks[rank]
        error = seen["error"]
        assert error is not None, f"rank {rank} returned from save as if the checkpoint counted"
        assert error["oserror"], (rank, error)  # an OSError, as a full disk would be
        assert error["errno"] == errno.EACCES, (rank, error)
        assert "rank 0" in error["strerror"], (rank, error)  # who failed, on every rank
        assert seen["listed"] == [], (rank, seen)  # nothing was published
    assert ranks[0]["error"] == ranks[1]["error"]


# ---------------------------------------------------------------- the script


def _hold_partial_renames(case: str, count: list[int]) -> dict:
    """Rank 0's os.rename and os.replace (pathlib's rename calls os.rename) of the partial
    directory: slowed, or failing with EACCES. Every other rename is left alone. Returns the
    real functions, to put back."""
    real = {name: getattr(os, name) for name in ("rename", "replace")}
    for name, function in real.items():

        def held(src, dst, *args, _real=function, **kwargs):
            if Path(os.fsdecode(src)).name.endswith(".partial") and Path(src).is_dir():
                count[0] += 1
                if case == "failed-rename":
                    raise OSError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(src))
                time.sleep(RENAME_DELAY_S)
            return _real(src, dst, *args, **kwargs)

        setattr(os, name, held)
    return real


def _rank_main(rank: int, folder: Path, port: int) -> None:
    import torch
    import torch.distributed as dist

    # The engine's checkpoint modules import torch.distributed.nn (engine.distributed) and
    # torch.distributed.checkpoint: imported after the group exists, they would hold it past
    # destroy_process_group, and gloo's threads would end during interpreter shutdown, which
    # sometimes aborts a finished rank (SIGABRT; engine/distributed.py says why). Imported
    # here, first, as the engine does; the group is ended by the engine's ordered shutdown.
    from engine import distributed as engine_dist
    from engine.checkpoint import sharded  # noqa: F401

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    for case in CASES:
        torch.manual_seed(0)
        _run_case(rank, case, folder / case)
        dist.barrier()  # both ranks have looked before the next case saves
    engine_dist.shutdown()


def _run_case(rank: int, case: str, folder: Path) -> None:
    import torch
    from torch import nn

    from engine import checkpoint as ckpt
    from engine.checkpoint import sharded

    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()
    folder.mkdir(parents=True, exist_ok=True)
    checkpoints = folder / "checkpoints"
    path = ckpt.sharded_path(checkpoints, STEP)
    held, real = [0], {}
    if rank == 0:
        real = _hold_partial_renames(case, held)
    seen = {"error": None}
    try:
        sharded.save(path, model, optimizer, {"step": STEP})
    except Exception as err:  # recorded, for the parent to say what went wrong
        seen["error"] = {
            "type": type(err).__name__,
            "oserror": isinstance(err, OSError),
            "errno": getattr(err, "errno", None),
            "strerror": getattr(err, "strerror", None) or str(err),
        }
    # what this rank finds at once, before any other collective could let rank 0 catch up
    seen["published"] = path.is_dir() and {"meta.pt", ".metadata"} <= {
        p.name for p in path.iterdir()
    }
    seen["partial_left"] = any(p.name.endswith(".partial") for p in checkpoints.iterdir())
    seen["listed"] = [p.name for p in ckpt.list_checkpoints(checkpoints)]
    seen["meta_step"] = sharded.read_meta(path)["step"] if seen["published"] else None
    seen["renames_held"] = held[0]
    for name, function in real.items():
        setattr(os, name, function)
    (folder / f"rank-{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(Path(sys.argv[1]), int(sys.argv[2])), nprocs=2)


def test_a_background_write_that_failed_is_not_published_on_close(tmp_path):
    """close() after an error waits for the write and publishes only a complete one: a write
    that failed, its partial directory holding meta.pt all the same, never becomes step-N/."""
    from concurrent.futures import Future

    from engine.checkpoint import sharded
    from engine.checkpoint.files import partial_path

    def closed(error: Exception | None) -> sharded.BackgroundWriter:
        path = tmp_path / f"step-0000000{1 if error else 2}"
        (partial_path(path) / sharded.META).parent.mkdir(parents=True)
        (partial_path(path) / sharded.META).write_bytes(b"meta")
        future: Future = Future()
        future.set_exception(error) if error else future.set_result(None)
        writer = sharded.BackgroundWriter(timeout_s=60)
        writer.writing = sharded.Writing(path, future, 0.0)
        writer.close()
        return path

    failed = closed(OSError(errno.ENOSPC, "No space left on device"))
    assert not failed.exists() and partial_path(failed).is_dir()  # the next start clears it
    written = closed(None)
    assert written.is_dir() and not partial_path(written).exists()
