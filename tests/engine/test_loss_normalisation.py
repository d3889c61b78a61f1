"""The loop's loss normalisation (engine.train's train_step and global_count): one optimizer
step's gradient is that of the task's loss summed over the whole global batch divided by
the global count of its units, here the tokens that are not IGNORE, however the batch is
split over micro batches and processes. The ignored tokens are spread unevenly, so a
normalisation per micro batch or per rank, or one missing the world size, gives another
gradient.

The real set-up and step run on the gpt recipe (tiny); the micro batches are made here,
since the recipe's own data has no ignored tokens. One process runs in this process; two
run this file as a script (`worker`), each rank checking its own step."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.spawn import free_port
from engine.tasks import IGNORE, task_of
from tests.helpers import engine_env

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]

GLOBAL_BATCH, BLOCK = 4, 16
# Tokens of each sequence that count (the rest are IGNORE): 20 in the first half of the global
# batch, 13 in the second; 4, 16, 12 and 1 per sequence.
COUNTED = (4, 16, 12, 1)
TINY_GPT = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    f"model.context={BLOCK}",
    f"data.block_size={BLOCK}",
    "data.eval_fraction=0.01",
    f"train.batch_size={GLOBAL_BATCH}",
    "train.grad_clip=0",  # clipping would rescale the gradients compared here
    "train.amp=off",
    "train.compile=off",
    "dist.strategy=auto",
    "dist.timeout_s=60",
    "sched.warmup_steps=1",
    "loader.num_workers=0",
    "log.wandb=off",
    "log.progress=plain",
    "device=cpu",
]


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [GLOBAL_BATCH, BLOCK]; sequence i counts its last COUNTED[i] targets."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, 256, (GLOBAL_BATCH, BLOCK), generator=g)
    y = torch.randint(0, 256, (GLOBAL_BATCH, BLOCK), generator=g)
    for i, counted in enumerate(COUNTED):
        y[i, : BLOCK - counted] = IGNORE
    return x, y


def step_against_reference(root: Path, name: str, rank: int, world: int, accum: int) -> dict:
    """One real engine step on this rank's part of the global batch, and the gradient and
    loss it should give, computed here from the whole global batch on a copy of the model."""
    from engine import catalog
    from engine import distributed as D
    from engine.assemble import setup
    from engine.train import train_step

    micro = GLOBAL_BATCH // (world * accum)
    overrides = [*TINY_GPT, f"train.micro_batch_size={micro}", f"run.root={root}"]
    cfg, recipe = catalog.load_config("gpt", [*overrides, f"run.name={name}"])
    denv = D.read_env()
    device = torch.device("cpu")
    run = setup(cfg, recipe, denv, device)
    try:
        assert run.denv.world_size == world and run.feed.sampler.plan.accum_steps == accum
        x, y = global_batch()
        assert int((y != IGNORE).sum()) == sum(COUNTED)

        reference = copy.deepcopy(run.net.bare)  # the weights before the step
        expected_loss = task_of(recipe).train_loss(reference(x), y, 0.0) / sum(COUNTED)
        expected_loss.backward()
        expected = {n: p.grad.clone() for n, p in reference.named_parameters()}

        grads = {}
        names = {p: n for n, p in run.net.bare.named_parameters()}

        def keep_gradients(optimizer, args, kwargs):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    grads[names[p]] = p.grad.detach().clone()

        run.opt.optimizer.register_step_pre_hook(keep_gradients)
        mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        batches = [
            SimpleNamespace(x=xs, y=ys)
            for xs, ys in zip(x[mine].split(micro), y[mine].split(micro), strict=True)
        ]
        assert len(batches) == accum
        loss, _ = train_step(run, batches)
        logged = D.all_reduce_sum(loss.detach().clone().reshape(1)) / world  # as the meter does
        return {
            "loss": (float(logged), float(expected_loss.detach())),
            "grads": grads,
            "expected": expected,
        }
    finally:
        run.records.tracker.close()
        if run.held.lock_fd is not None:
            os.close(run.held.lock_fd)


def check(result: dict) -> None:
    """The step's gradients, then the loss the meter logs, against the global batch's."""
    grads, expected = result["grads"], result["expected"]
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    loss, expected_loss = result["loss"]
    assert loss == pytest.approx(expected_loss, rel=1e-5), (loss, expected_loss)


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_one_process_step_gradient_is_the_global_sum_over_the_counted_tokens(tmp_path, accum):
    check(step_against_reference(tmp_path, f"accum{accum}", 0, 1, accum))


@pytest.mark.dist
@pytest.mark.slow
def test_two_processes_step_gradient_is_the_global_sum_over_the_counted_tokens(tmp_path):
    """2 processes x 1 micro batch and 2 x 2: the count is summed over the ranks, and the
    gradients DDP averages over them are those of the global loss."""
    port, env = free_port(), engine_env()
    out = subprocess.run(
        [sys.executable, str(HERE), "worker", str(tmp_path), str(port)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for accum in (1, 2):
        for rank in (0, 1):
            saved = torch.load(tmp_path / f"result-{accum}-{rank}.pt", weights_only=True)
            check(saved)


def _worker(rank: int, root: Path, port: int) -> None:
    from engine import distributed as D
    from engine.config import DistConfig

    os.environ |= {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    denv = D.read_env()
    D.init(denv, DistConfig(timeout_s=60), torch.device("cpu"))
    try:
        for accum in (1, 2):
            result = step_against_reference(root, f"two-x{accum}", rank, 2, accum)
            torch.save(result, root / f"result-{accum}-{rank}.pt")
            print(json.dumps({"rank": rank, "accum": accum, "loss": result["loss"]}))
    finally:
        D.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(Path(sys.argv[2]), int(sys.argv[3])), nprocs=2)
