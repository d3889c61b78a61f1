"""FSDP2 and sharded checkpoints on the gpt recipe, in real processes with gloo on CPU:
FSDP trains like DDP, hybrid sharding (a 2-D mesh on 4 processes) like FSDP, its checkpoint
resumes on 2 processes and on 1 with the same samples, a checkpoint killed mid-write (in the
background) is never chosen and the last resumes bitwise, exports of DDP and FSDP
checkpoints give the run's evaluation loss in a fresh process, and activation checkpointing
changes nothing but memory."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from engine import checkpoint as ckpt
from engine import export
from engine.config import build_section, with_weights_init
from engine.faults import InjectedFault
from recipes.gpt.model import ModelConfig, flops_per_token
from tests.helpers import QUIET, REPO, engine_env, records, run_dir, run_engine, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]
GPT = [
    "train.max_steps=8",
    "log.every_steps=1",
    "ckpt.every_steps=4",
    "log.sample_ids=true",
    # 801 held-out blocks: 401 on rank 0 (2 batches), 400 on rank 1 (1 batch). Under FSDP
    # every forward pass gathers each block's weights from all ranks, so rank 1 must join
    # rank 0's extra pass; if it did not, the run would stop at the timeout.
    "data.eval_fraction=0.11",
    "eval.batch_size=400",
    "dist.timeout_s=60",
    "log.peak_tflops=1",  # a peak for MFU on the CPU
]
FSDP = [*GPT, "dist.strategy=fsdp"]
# Hybrid sharding on 4 processes, a (replicate=2, shard=2) mesh, checkpoints written while
# training goes on
HSDP = [*FSDP, "dist.replicate=2", "ckpt.async_save=true"]
# Dropout draws from each rank's RNG stream: a resume on as many processes must restore it.
DROPOUT = [*FSDP, "model.dropout=0.1"]
TOLERANCE = 1e-5  # float rounding: gradients summed in another order


def gpt(root, name, *overrides, procs=2, **kwargs):
    """A gpt run on procs processes started by the engine's --spawn: the ranks run the path
    torchrun's do (tests/distributed proves the two train alike), from one import of torch
    instead of one per rank and one for torchrun. The killed run below and the digits
    parity test run under torchrun itself."""
    prefix = [sys.executable, "-m", "engine.train", "--spawn", str(procs)] if procs > 1 else None
    return run_engine(root, name, *overrides, prefix=prefix, recipe="gpt", **kwargs)


def losses(root, name, recipe="gpt") -> list[float]:
    return [r["loss"] for r in records(root, name, "train", recipe)]


def load_run_config(root, name) -> dict:
    return yaml.safe_load((run_dir(root, name, "gpt") / "config.yaml").read_text())


def final_eval(root, name) -> dict:
    return records(root, name, "eval", "gpt")[-1]


def trained_ids(root, name) -> list[list[int]]:
    lines = (run_dir(root, name, "gpt") / "samples.jsonl").read_text().splitlines()
    return [json.loads(line)["ids"] for line in lines]


def close(a: list[float], b: list[float], tolerance: float) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) <= tolerance * max(1, abs(y)) for x, y in zip(a, b, strict=False)
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def ddp(root):
    gpt(root, "ddp", *GPT, "dist.strategy=ddp")
    return root


@pytest.fixture(scope="module")
def fsdp(root):
    gpt(root, "fsdp", *FSDP)
    return root


@pytest.fixture(scope="module")
def hsdp(root):
    gpt(root, "hsdp", *HSDP, procs=4)
    return root


def test_fsdp_trains_like_ddp_and_writes_sharded_checkpoints(ddp, fsdp):
    assert close(losses(fsdp, "fsdp"), losses(ddp, "ddp"), TOLERANCE)
    # per byte from the first step: an untrained model's loss is ln 256 (a sum per sample,
    # or over one rank's tokens, would be orders of magnitude away)
    assert abs(losses(fsdp, "fsdp")[0] - math.log(256)) < 0.2
    assert final_eval(fsdp, "fsdp")["count"] == 801 * 64  # every held-out token once
    assert abs(final_eval(fsdp, "fsdp")["loss"] - final_eval(ddp, "ddp")["loss"]) < TOLERANCE
    assert trained_ids(fsdp, "fsdp") == trained_ids(ddp, "ddp")
    folder = run_dir(fsdp, "fsdp", "gpt") / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-00000008", "step-00000004"]
    assert all(p.is_dir() for p in folder.iterdir())
    shards = sorted((folder / "step-00000008").glob("*.distcp"))  # one file per rank
    sizes = [p.stat().st_size for p in shards]
    assert len(shards) == 2 and max(sizes) < 0.6 * sum(sizes)  # each rank holds about half
    summary = json.loads((run_dir(fsdp, "fsdp", "gpt") / "summary.json").read_text())
    assert summary["headline"] == "eval_loss" and summary["world_size"] == 2
    train = records(fsdp, "fsdp", "train", "gpt")[-1]
    assert train["tokens_per_s"] == pytest.approx(train["samples_per_s"] * 64)
    model = build_section(
        "model", with_weights_init(ModelConfig), load_run_config(fsdp, "fsdp")["model"]
    )
    declared = flops_per_token(model, 64) * 64  # the recipe's FLOPs per sample
    assert train["mfu"] == pytest.approx(train["samples_per_s"] * declared / 2e12)  # 2 x 1 TF


def test_hybrid_sharding_trains_like_fsdp_and_resumes_on_two_processes(fsdp, hsdp):
    """4 processes on a (2, 2) mesh train on the same samples per step as 1-D FSDP on 2,
    with the same losses within float rounding; the step-4 checkpoint it wrote in the
    background resumes under 1-D FSDP on 2 processes, as if never stopped."""
    log = (run_dir(hsdp, "hsdp", "gpt") / "train.log").read_text()
    assert "FSDP2 on a 2-D mesh (replicate=2, shard=2)" in log, log
    assert trained_ids(hsdp, "hsdp") == trained_ids(fsdp, "fsdp")
    assert close(losses(hsdp, "hsdp"), losses(fsdp, "fsdp"), TOLERANCE)
    assert final_eval(hsdp, "hsdp")["count"] == 801 * 64  # every held-out token once
    assert abs(final_eval(hsdp, "hsdp")["loss"] - final_eval(fsdp, "fsdp")["loss"]) < TOLERANCE
    folder = run_dir(hsdp, "hsdp", "gpt") / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-00000008", "step-00000004"]
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # nothing partial left
    middle = folder / "step-00000004"
    out = gpt(hsdp, "hsdp-on-two", *FSDP, f"resume={middle}")
    assert f"resuming from {middle} (epoch 0, step 4)" in out.stderr, out.stderr
    assert trained_ids(hsdp, "hsdp-on-two") == trained_ids(hsdp, "hsdp")[4:]
    assert close(losses(hsdp, "hsdp-on-two"), losses(hsdp, "hsdp")[4:], TOLERANCE)


def test_a_hybrid_sharded_checkpoint_resumes_on_one_process(hsdp, train_here, capsys):
    """The HSDP run's step-4 checkpoint (four processes wrote it, in the background) resumed
    on one (this one: tests/engine/conftest.py): the same samples, the same losses within
    float rounding."""
    middle = run_dir(hsdp, "hsdp", "gpt") / "checkpoints" / "step-00000004"
    capsys.readouterr()
    train_here(hsdp, "on-one", *FSDP, f"resume={middle}", recipe="gpt")
    said = capsys.readouterr().err
    assert f"resuming from {middle} (epoch 0, step 4)" in said, said
    assert trained_ids(hsdp, "on-one") == trained_ids(hsdp, "hsdp")[4:]
    assert close(losses(hsdp, "on-one"), losses(hsdp, "hsdp")[4:], TOLERANCE)
    assert abs(final_eval(hsdp, "on-one")["loss"] - final_eval(hsdp, "hsdp")["loss"]) < 1e-4


def test_a_checkpoint_killed_mid_write_is_never_chosen_and_the_last_resumes_bitwise(root):
    """Killed while writing step 8's checkpoint in the background (ckpt.async_save), the run
    resumes from step 4's on two processes as if never stopped (the uninterrupted run writes
    its checkpoints before going on): the same samples, losses, evaluation and dropout masks
    (each rank's RNG stream restored)."""
    gpt(root, "uninterrupted", *DROPOUT)
    background = [*DROPOUT, "ckpt.async_save=true"]
    args = [*torchrun(2), "gpt", *QUIET, f"run.root={root}", "run.name=killed", *background]
    proc = subprocess.Popen(
        [*args, "fault.hang_in_save_at_step=8"],
        cwd=REPO,
        env=engine_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    folder = run_dir(root, "killed", "gpt") / "checkpoints"
    deadline = time.monotonic() + 240
    while not (folder / ".step-00000008.partial" / "meta.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no partial checkpoint"
        time.sleep(0.05)
    for pid in [*descendants(proc.pid), proc.pid]:  # the ranks, then torchrun: no clean-up
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-00000004"]
    out = gpt(root, "killed", *background)
    assert "removed .step-00000008.partial" in out.stderr, out.stderr
    assert "resuming from" in out.stderr and "step-00000004 (epoch 0, step 4)" in out.stderr
    assert losses(root, "killed") == losses(root, "uninterrupted")
    assert final_eval(root, "killed") == final_eval(root, "uninterrupted")
    assert trained_ids(root, "killed") == trained_ids(root, "uninterrupted")
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_a_run_failing_while_a_checkpoint_is_written_in_the_background_waits_and_keeps_it(
    tmp_path, train_here
):
    """Step 4's checkpoint is still unpublished (ckpt.async_save publishes it at the next
    save) when step 6 fails: on the way out the run waits for the write and publishes it,
    and a rerun resumes from it. (One process, this one: tests/engine/conftest.py.)"""
    same = ["train.max_steps=8", "ckpt.every_steps=4", "dist.strategy=fsdp"]
    with pytest.raises(InjectedFault):
        train_here(tmp_path, "failed", *same, "ckpt.async_save=true", "fault.raise_at_step=6")
    folder = run_dir(tmp_path, "failed") / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["step-00000004"]  # complete, nothing partial
    assert ckpt.latest_valid(folder)[1]["step"] == 4


def descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun starts its ranks in sessions of their own)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children = task / "children"
        for child in map(int, children.read_text().split() if children.exists() else []):
            found += [child, *descendants(child)]
    return found


EVALUATE = """
import json, sys
import torch
from engine.config import build_section, with_weights_init
from engine.faults import InjectedFault
from recipes.gpt.recipe import RECIPE
losses = []
for config, weights in json.loads(sys.argv[1]):
    if weights.endswith(".pt"):
        state = torch.load(weights, map_location="cpu", weights_only=True)
    else:
        from safetensors.torch import load_file
        state = load_file(weights)
    model_config = with_weights_init(RECIPE.model_config)  # the engine adds model.init_from etc.
    model = RECIPE.build_model(build_section("model", model_config, config["model"]))
    model.load_state_dict(state, strict=True)
    _, held_out = RECIPE.build_datasets(build_section("data", RECIPE.data_config, config["data"]))
    loss = count = 0.0
    with torch.no_grad():
        for i in range(0, len(held_out), 64):
            x, y = (torch.stack(t) for t in zip(*(held_out[j] for j in range(i, min(i + 64, len(held_out))))))
            sums = RECIPE.task.eval_sums(model.eval()(x), y)
            loss, count = loss + sums["loss"].sum().item(), count + sums["count"].sum().item()
    losses.append(loss / count)
print(json.dumps(losses))
"""
EXPORTS = [
    ("ddp", "step-00000008.pt", ".pt"),
    ("fsdp", "step-00000008", ".pt"),
    ("fsdp", "step-00000008", ".safetensors"),
]


def test_exports_load_in_one_plain_process_with_the_runs_eval_loss(ddp, fsdp, tmp_path):
    """Each export (a DDP checkpoint's, an FSDP one's as .pt and as .safetensors) loads
    strictly into the recipe's model in a fresh process, without the engine's run or a
    process group, and evaluates to the run's loss."""
    jobs = []
    for run, checkpoint, suffix in EXPORTS:
        source = run_dir(ddp, run, "gpt") / "checkpoints" / checkpoint
        out = tmp_path / f"{run}-{checkpoint}{suffix}"
        assert export.main([str(source), str(out)]) == 0, (run, checkpoint, suffix)
        jobs.append((ckpt.load(source)["config"], str(out)))
    fresh = subprocess.run(
        [sys.executable, "-c", EVALUATE, json.dumps(jobs)],
        cwd=REPO, env=engine_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr
    for (run, checkpoint, suffix), loss in zip(EXPORTS, json.loads(fresh.stdout), strict=True):
        assert abs(loss - final_eval(ddp, run)["loss"]) < 1e-6, (run, checkpoint, suffix)


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path, train_here):
    """Dropout on: the recomputed forward must draw the same masks. (One process each, in
    this one: tests/engine/conftest.py.)"""
    same = ["train.max_steps=4", "log.every_steps=1", "model.dropout=0.2"]
    train_here(tmp_path, "kept", *same, recipe="gpt")
    train_here(tmp_path, "recomputed", *same, "train.activation_checkpointing=true", recipe="gpt")
    assert losses(tmp_path, "recomputed") == losses(tmp_path, "kept")
    assert final_eval(tmp_path, "recomputed") == final_eval(tmp_path, "kept")


def test_one_process_with_accumulation_trains_like_two(ddp, tmp_path, train_here):
    """The loss is normalised by the global token count, whatever the split."""
    train_here(tmp_path, "accumulated", *GPT, "train.micro_batch_size=8", recipe="gpt")
    assert close(losses(tmp_path, "accumulated"), losses(ddp, "ddp"), TOLERANCE)


def test_a_model_built_with_storage_trains_under_fsdp_like_ddp(tmp_path):
    """digits declares no init_weights: each rank builds the model from its own RNG stream and
    rank 0's weights are broadcast before sharding, as DDP does; SGD (no fused kernel for
    sharded parameters), no blocks (the whole model is one unit), channels_last left off."""
    # 359 held-out images: 180 on rank 0 (2 batches of up to 179), 179 on rank 1 (1 batch)
    same = [
        "train.max_steps=6",
        "log.every_steps=1",
        "model.norm=group",
        "eval.batch_size=179",
        "dist.timeout_s=60",
    ]
    run_engine(tmp_path, "ddp", *same, "dist.strategy=ddp", prefix=torchrun(2))
    run_engine(tmp_path, "fsdp", *same, "dist.strategy=fsdp", prefix=torchrun(2))
    assert close(losses(tmp_path, "fsdp", "digits"), losses(tmp_path, "ddp", "digits"), TOLERANCE)
    evaluations = [records(tmp_path, n, "eval")[-1] for n in ("fsdp", "ddp")]
    assert evaluations[0]["top1"] == evaluations[1]["top1"]
    assert evaluations[0]["count"] == evaluations[1]["count"] == 359  # each image once


def test_a_single_file_checkpoint_is_not_resumed_sharded_in_one_line(ddp):
    shutil.copytree(run_dir(ddp, "ddp", "gpt"), run_dir(ddp, "ddp-then-fsdp", "gpt"))
    out = gpt(ddp, "ddp-then-fsdp", *FSDP, "train.max_steps=12", check=False)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and len(errors) == 1, out.stderr
    assert "is a single file" in errors[0] and "dist.strategy=ddp" in errors[0]


def test_bf16_mixed_precision_keeps_fp32_weights_and_trains_alike(fsdp, tmp_path):
    """bf16 parameters and compute in each gathered block, fp32 gradient reduction, and
    fp32 sharded weights that the optimizer updates (and the checkpoint holds)."""
    gpt(tmp_path, "bf16", *FSDP, "train.amp=bf16")
    assert close(losses(tmp_path, "bf16"), losses(fsdp, "fsdp"), 1e-2)
    assert losses(tmp_path, "bf16") != losses(fsdp, "fsdp")  # bf16 did run
    from engine.checkpoint import sharded

    saved = sharded.model_tensors(
        run_dir(tmp_path, "bf16", "gpt") / "checkpoints" / "step-00000008"
    )
    assert {t.dtype for t in saved.values()} == {torch.float32}


def test_init_from_loads_into_a_model_sharded_from_the_meta_device(ddp, tmp_path):
    """gpt is built on the meta device and initialised shard by shard under FSDP: a file's
    weights (the DDP run's, exported) go into each process's shards (every process read the
    whole file). At lr x 0 the sharded run's checkpoint holds exactly the file's weights."""
    source = tmp_path / "base.pt"
    tensors, info = export.read_weights(export.resolve(run_dir(ddp, "ddp", "gpt")), ema=False)
    export.write(tensors, source, info)
    gpt(
        tmp_path,
        "ft",
        *FSDP,
        f"model.init_from={source}",
        "optim.lr_mult=[*=0]",
        "train.max_steps=2",
        "ckpt.every_steps=0",
    )
    newest = max((run_dir(tmp_path, "ft", "gpt") / "checkpoints").glob("step-*"))
    from engine.weights import files

    loaded = files.checkpoint_tensors(newest, ema=False)
    base = torch.load(source, weights_only=True)
    assert loaded.keys() == base.keys()
    assert all(torch.equal(loaded[k], base[k]) for k in base)
    init = json.loads((run_dir(tmp_path, "ft", "gpt") / "summary.json").read_text())["init"]
    assert init["loaded"] == len(base) and init["reinitialised"] == []
