"""Sharded checkpoints (engine.checkpoint.sharded): round trips bit for bit, N processes
to one, counted only once complete (written in the background too), listed and pruned beside
single-file checkpoints.

The multi-process cases run this file as a script (`worker`, `slow-save`), so the processes
are real and the parent checks what they left on disk."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import checkpoint as ckpt
from engine import rundir
from engine.checkpoint import sharded
from engine.config import ConfigError
from engine.spawn import free_port

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]


class Net(nn.Module):
    """Blocks to shard one by one (FSDP2), and a head whose 3 rows split unevenly over 2."""

    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def trained(seed: int = 0, **shape) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(**shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.05)
    step(model, optimizer, seed)
    return model, optimizer


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def optimizer_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{parameter name: {exp_avg, exp_avg_sq, step}} as full plain tensors."""
    full = {}
    for name, param in model.named_parameters():
        full[name] = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in optimizer.state[param].items()
        }
    return full


def assert_same(model_a, opt_a, model_b, opt_b) -> None:
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    oa, ob = optimizer_states(model_a, opt_a), optimizer_states(model_b, opt_b)
    for name in oa:
        for k in oa[name]:
            assert torch.equal(oa[name][k], ob[name][k]), (name, k)


# ---------------------------------------------------------------- one process


def test_round_trip_is_bitwise_and_training_continues_alike(tmp_path):
    model, optimizer = trained(seed=0)
    meta = {"step": 1, "epoch": 0, "rng": [torch.get_rng_state()], "config": {"seed": 0}}
    path = ckpt.sharded_path(tmp_path, 1)
    sharded.save(path, model, optimizer, meta)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]

    other, other_opt = trained(seed=7)  # different weights and states, to be overwritten
    loaded_meta = sharded.load(path, other, other_opt)
    assert loaded_meta.keys() == meta.keys() and loaded_meta["step"] == 1
    assert torch.equal(loaded_meta["rng"][0], meta["rng"][0])
    assert loaded_meta["config"] == {"seed": 0}
    assert_same(model, optimizer, other, other_opt)
    assert other_opt.param_groups[0]["lr"] == 0.1
    step(model, optimizer, 3)
    step(other, other_opt, 3)
    assert_same(model, optimizer, other, other_opt)
    assert ckpt.load(path)["step"] == 1  # the meta dict, as for resume=<path>


def test_a_background_write_holds_the_state_at_its_start_and_counts_once_finished(tmp_path):
    """ckpt.async_save: start returns with the shards copied; training changes the live
    weights and optimizer states meanwhile; the checkpoint is listed only after finish, and
    holds the state of the step it was started at."""
    model, optimizer = trained(seed=0)
    writer = sharded.BackgroundWriter(timeout_s=60)
    path = ckpt.sharded_path(tmp_path, 1)
    writer.start(path, model, optimizer, {"step": 1})
    step(model, optimizer, 3)  # the next step, while the copy is being written
    assert ckpt.list_checkpoints(tmp_path) == []  # not published before finish
    assert writer.finish() == path and writer.finish() is None
    assert ckpt.list_checkpoints(tmp_path) == [path]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial left
    as_started, as_started_opt = trained(seed=0)
    loaded, loaded_opt = trained(seed=7)
    assert sharded.load(path, loaded, loaded_opt)["step"] == 1
    assert_same(loaded, loaded_opt, as_started, as_started_opt)


def test_the_same_step_written_again_replaces_it(tmp_path):
    path = ckpt.sharded_path(tmp_path, 4)
    first, opt = trained(seed=0)
    sharded.save(path, first, opt, {"step": 4, "which": "first"})
    second, opt2 = trained(seed=1)
    sharded.save(path, second, opt2, {"step": 4, "which": "second"})
    assert sharded.read_meta(path)["which"] == "second"
    assert torch.equal(sharded.model_tensors(path)["head.weight"], second.head.weight)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # nothing hidden left


def test_a_checkpoint_of_another_model_is_a_one_line_config_error(tmp_path):
    path = ckpt.sharded_path(tmp_path, 1)
    model, optimizer = trained()
    sharded.save(path, model, optimizer, {"step": 1})
    narrow = Net(width=6)
    with pytest.raises(ConfigError) as err:
        sharded.load(path, narrow, torch.optim.AdamW(narrow.parameters()))
    text = str(err.value)
    assert "\n" not in text and "does not fit this model" in text
    assert "shape blocks.0.0.bias: saved [8], model [6], blocks.0.0.weight: saved [8, 8]" in text
    with pytest.raises(ConfigError, match=r"missing blocks\.2\.0\.bias, blocks\.2\.0\.weight"):
        sharded.load(path, Net(depth=3))
    with pytest.raises(ConfigError, match=r"unexpected blocks\.1\.0\.bias"):
        sharded.load(path, Net(depth=1))


def test_listing_mixes_files_and_directories_newest_first_and_prunes_both(tmp_path):
    model, optimizer = trained()
    for s in (2, 6):
        sharded.save(ckpt.sharded_path(tmp_path, s), model, optimizer, {"step": s})
    for s in (4, 8):
        ckpt.atomic_save({"step": s}, ckpt.checkpoint_path(tmp_path, s))
    (tmp_path / ".step-00000010.partial").mkdir()  # a writer died here
    (tmp_path / "step-00000012").write_text("a file without .pt is no checkpoint")
    (tmp_path / "notes").mkdir()
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-00000008.pt", "step-00000006", "step-00000004.pt", "step-00000002"]
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(tmp_path)] == [8, 6, 4, 2]

    ckpt.prune(tmp_path, keep=2, written=ckpt.checkpoint_path(tmp_path, 8))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000008.pt",
        "step-00000006",
    ]
    ckpt.prune(tmp_path, keep=1, written=ckpt.checkpoint_path(tmp_path, 8))
    assert not (tmp_path / "step-00000006").exists()
    assert not list(tmp_path.glob(".step-*.old"))

    removed = rundir.remove_partial_checkpoints(tmp_path)
    assert [p.name for p in removed] == [".step-00000010.partial"]
    assert not (tmp_path / ".step-00000010.partial").exists()


def test_a_run_with_only_sharded_checkpoints_is_a_run_and_a_partial_one_is_not(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    (folder / ".step-00000002.partial").mkdir(parents=True)
    assert not rundir.holds_a_run(tmp_path / "run")  # resume=none may start here afresh
    model, optimizer = trained()
    sharded.save(ckpt.sharded_path(folder, 4), model, optimizer, {"step": 4})
    assert rundir.holds_a_run(tmp_path / "run")  # resume=none refuses to overwrite it


def test_latest_valid_skips_an_incomplete_directory(tmp_path, capsys):
    model, optimizer = trained()
    for s in (2, 4, 6):
        sharded.save(ckpt.sharded_path(tmp_path, s), model, optimizer, {"step": s})
    (ckpt.sharded_path(tmp_path, 6) / ".metadata").unlink()
    (ckpt.sharded_path(tmp_path, 4) / "meta.pt").write_bytes(b"torn")
    path, meta = ckpt.latest_valid(tmp_path)
    assert path.name == "step-00000002" and meta["step"] == 2
    err = capsys.readouterr().err
    assert "warning: skipping unreadable checkpoint" in err
    assert "step-00000006" in err and "step-00000004" in err
    with pytest.raises(ConfigError, match="not a complete sharded checkpoint"):
        sharded.load(ckpt.sharded_path(tmp_path, 6), model)


# ---------------------------------------------------------------- real processes


def script_env() -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_on_two_processes_loads_on_one_and_a_full_disk_fails_every_rank(tmp_path):
    out = subprocess.run(
        [sys.executable, str(HERE), "worker", str(tmp_path), str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env=script_env(),
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    folder = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-00000001"]
    path = ckpt.sharded_path(folder, 1)
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in path.iterdir()}

    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    model = Net()  # plain, one process, no process group; other weights until loaded
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    meta = sharded.load(path, model, optimizer)
    assert meta["world_size"] == 2 and len(meta["rng"]) == 2
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected["model"][key]), key
    states = optimizer_states(model, optimizer)
    for name, state in expected["optim"].items():
        for k, v in state.items():
            assert torch.equal(states[name][k], v), (name, k)
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert sharded.model_tensors(path).keys() == expected["model"].keys()

    # rank 1 could not write its shard: both ranks raised the same OSError, nothing listed
    errors = [(tmp_path / f"error-{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("OSError 27: File too large") and "rank 1" in errors[0]
    assert (folder / ".step-00000002.partial").is_dir()
    # written in the background, the same failure surfaces from finish, not start
    errors = [(tmp_path / f"async-error-{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("start returned; OSError 27: File too large"), errors
    assert "rank 1, writing the shards" in errors[0], errors
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-00000001"]


def test_a_writer_killed_before_the_rename_leaves_no_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, str(HERE), "slow-save", str(folder)], env=script_env(), cwd=REPO
    )
    try:
        deadline = time.monotonic() + 60
        while not (folder / ".step-00000004.partial" / "meta.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no partial checkpoint"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-00000002"]
    path, meta = ckpt.latest_valid(folder)
    assert path.name == "step-00000002" and meta["step"] == 2
    assert [p.name for p in rundir.remove_partial_checkpoints(folder)] == [".step-00000004.partial"]


# ---------------------------------------------------------------- the scripts


def _worker(rank: int, folder: Path, port: int) -> None:
    import resource

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.05)
    step(model, optimizer, seed=rank)  # each rank its own data, as in training
    rngs = [None, None]
    dist.all_gather_object(rngs, torch.get_rng_state())
    meta = {"step": 1, "world_size": 2, "rng": rngs}
    sharded.save(ckpt.sharded_path(folder / "checkpoints", 1), model, optimizer, meta)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    optim = optimizer_states(model, optimizer)
    if rank == 0:
        torch.save({"model": full, "optim": optim}, folder / "expected.pt")

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        sharded.save(ckpt.sharded_path(folder / "checkpoints", 2), model, optimizer, meta)
        error = "no error"
    except OSError as err:
        error = f"OSError {err.errno}: {err.strerror}"
    (folder / f"error-{rank}.txt").write_text(error)
    # the same failure in the background (ckpt.async_save): raised by finish on every rank
    writer = sharded.BackgroundWriter(timeout_s=60)
    try:
        writer.start(ckpt.sharded_path(folder / "checkpoints", 3), model, optimizer, meta)
        error = "start returned"
        writer.finish()
        error = "no error"
    except OSError as err:
        error = f"{error}; OSError {err.errno}: {err.strerror}"
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    (folder / f"async-error-{rank}.txt").write_text(error)
    dist.barrier()
    # Release the sharded model before the group, as engine.train does: gloo's threads then
    # end with the group rather than during interpreter shutdown (a SIGABRT at exit).
    del model, optimizer, full, optim
    gc.collect()
    dist.destroy_process_group()


def _slow_save(folder: Path) -> None:
    model, optimizer = trained()
    sharded.save(ckpt.sharded_path(folder, 2), model, optimizer, {"step": 2})
    sharded.save(ckpt.sharded_path(folder, 4), model, optimizer, {"step": 4}, pause_s=60)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(Path(sys.argv[2]), int(sys.argv[3])), nprocs=2)
    elif sys.argv[1] == "slow-save":
        _slow_save(Path(sys.argv[2]))
