"""Tensor parallelism (dist.tp) on the gpt recipe, in real processes with gloo on CPU: tp=2 on 2
processes and tp=2 x FSDP 2 on 4 train like one process on the same samples per step; their
checkpoints resume bitwise on the same layout and within rounding on another (1 process,
FSDP on 2); an export is the 1-process model's weights; a layout the plan cannot split is
one line before anything starts.

TOLERANCE: float32 rounding. A row-parallel projection sums its partial products across the
TP group in another order than one process's matrix multiply (and FSDP sums gradients in
another order again): ~1e-7 relative per step, grown by AdamW over 8 steps. A wrong plan (a
projection split the wrong way, a TP group reading two batches, a sample counted twice) moves
the loss by 1e-3 or more, or stops the run."""

import pytest
import torch

from engine import export
from engine.config import ConfigError
from engine.parallel import check_layout, check_tensor_parallel
from tests.engine.parallel.test_fsdp import (
    GPT,
    TOLERANCE,
    close,
    final_eval,
    gpt,
    losses,
    trained_ids,
)
from tests.helpers import engine_process, launch, run_dir

TP = [*GPT, "dist.strategy=fsdp", "dist.tp=2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def one(root, train_here):
    """The reference: one process, trained in this one (its process is not the subject)."""
    train_here(root, "one", *GPT, "dist.strategy=fsdp", recipe="gpt")
    return root


@pytest.fixture(scope="module")
def tp2(root):
    """dist.strategy left at auto: under dist.tp it is what tensor parallelism needs (FSDP2
    over the data-parallel ranks), so this run trains as TP's layout with fsdp does."""
    gpt(root, "tp2", *GPT, "dist.tp=2")
    return root


@pytest.fixture(scope="module")
def tp2_fsdp2(root):
    """The 1b variant's layout in small: TP inside groups, FSDP across, blocks recomputed."""
    gpt(root, "tp2-fsdp2", *TP, "train.activation_checkpointing=true", procs=4)
    return root


@pytest.fixture(scope="module")
def fsdp4(root):
    gpt(root, "fsdp4", *GPT, "dist.strategy=fsdp", procs=4)
    return root


def checkpoint(root, name: str, step: int):
    return run_dir(root, name, "gpt") / "checkpoints" / f"step-{step:08d}"


@pytest.mark.dist
@pytest.mark.slow
def test_tensor_parallel_trains_like_one_process_on_the_same_samples(one, tp2, tp2_fsdp2, fsdp4):
    """tp=2 (one data-parallel rank), tp=2 x FSDP 2 (two, with activation checkpointing) and
    tp=1 x FSDP 4: the same samples per optimizer step as one process, the same losses and final evaluation within float rounding, each
    held-out token counted once, sharded checkpoints."""
    log = (run_dir(tp2_fsdp2, "tp2-fsdp2", "gpt") / "train.log").read_text()
    assert "tensor parallel on a 2-D mesh (data=2, tp=2)" in log, log
    reference = losses(one, "one")
    for name in ("tp2", "tp2-fsdp2", "fsdp4"):
        assert trained_ids(one, name) == trained_ids(one, "one"), name
        assert close(losses(one, name), reference, TOLERANCE), (name, losses(one, name))
        evaluated = final_eval(one, name)
        assert evaluated["count"] == final_eval(one, "one")["count"] == 801 * 64, name
        assert abs(evaluated["loss"] - final_eval(one, "one")["loss"]) < TOLERANCE, name
        assert checkpoint(one, name, 8).is_dir(), name


@pytest.mark.dist
@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_bitwise_on_the_same_layout(tp2):
    """Stopped at step 4 (mid-epoch) and resumed as tp=2 on 2 processes: as if never stopped,
    to the bit."""
    middle = checkpoint(tp2, "tp2", 4)
    out = gpt(tp2, "tp2-again", *TP, f"resume={middle}")
    assert f"resuming from {middle} (epoch 0, step 4)" in out.stderr, out.stderr
    assert trained_ids(tp2, "tp2-again") == trained_ids(tp2, "tp2")[4:]
    assert losses(tp2, "tp2-again") == losses(tp2, "tp2")[4:]
    assert final_eval(tp2, "tp2-again")["loss"] == final_eval(tp2, "tp2")["loss"]


@pytest.mark.dist
@pytest.mark.slow
def test_a_tp_and_fsdp_checkpoint_resumes_under_fsdp_alone(one, tp2_fsdp2):
    """tp=2 x FSDP 2's step-4 checkpoint resumed under FSDP on 2 processes (tp=1): the
    uninterrupted 1-process run's samples and losses within rounding."""
    middle = checkpoint(tp2_fsdp2, "tp2-fsdp2", 4)
    fsdp = [*GPT, "dist.strategy=fsdp"]
    out = gpt(one, "fsdp2-from-tp", *fsdp, f"resume={middle}")
    assert f"resuming from {middle} (epoch 0, step 4)" in out.stderr, out.stderr
    assert trained_ids(one, "fsdp2-from-tp") == trained_ids(one, "one")[4:]
    assert close(losses(one, "fsdp2-from-tp"), losses(one, "one")[4:], TOLERANCE)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("written_by", ["tp2", "tp2-fsdp2"])
def test_a_tensor_parallel_checkpoint_resumes_on_one_process(
    one, tp2, tp2_fsdp2, written_by, train_here
):
    """Held out: a step-4 checkpoint of tp=2 (2 processes) or tp=2 x FSDP 2 (4) resumed in
    one process (this one) trains the rest of the uninterrupted 1-process run within rounding,
    on the same samples, to the same evaluation."""
    middle = checkpoint(one, written_by, 4)
    name = f"one-from-{written_by}"
    train_here(one, name, *GPT, "dist.strategy=fsdp", f"resume={middle}", recipe="gpt")
    assert trained_ids(one, name) == trained_ids(one, "one")[4:]
    assert close(losses(one, name), losses(one, "one")[4:], TOLERANCE)
    assert abs(final_eval(one, name)["loss"] - final_eval(one, "one")["loss"]) < TOLERANCE


@pytest.mark.dist
@pytest.mark.slow
def test_an_export_of_a_tensor_parallel_run_is_the_one_process_models_weights(
    one, tp2_fsdp2, tmp_path
):
    """make export of the 4-process tp=2 x FSDP 2 checkpoint: one file of whole tensors under
    the 1-process model's names and shapes, equal to the 1-process run's within rounding."""
    exported = {}
    for name in ("one", "tp2-fsdp2"):
        out = tmp_path / f"{name}.pt"
        assert export.main([str(checkpoint(one, name, 8)), str(out)]) == 0
        exported[name] = torch.load(out, weights_only=True)
    mine, reference = (exported[n] for n in ("tp2-fsdp2", "one"))
    assert mine.keys() == reference.keys() and "blocks.0.attn.q.weight" in mine
    for key, tensor in reference.items():
        assert mine[key].shape == tensor.shape, key
        assert torch.allclose(mine[key], tensor, rtol=0, atol=1e-5), key


def layout_error(*overrides: str, world: int = 4, recipe: str = "gpt") -> str:
    from engine.catalog import load_config

    cfg, recipe_ = load_config(recipe, list(overrides))
    with pytest.raises(ConfigError) as err:
        check_layout(cfg, world)
        check_tensor_parallel(cfg, recipe_)
    return str(err.value)


@pytest.mark.parametrize(
    "overrides, world, said",
    [
        (["dist.strategy=fsdp", "dist.tp=3"], 3, "dist.tp=3 does not divide model.n_head=4"),
        (["dist.strategy=fsdp", "dist.tp=2", "data.block_size=15", "model.context=16"], 2,
         "dist.tp=2 does not divide data.block_size=15"),
        (["dist.strategy=fsdp", "dist.tp=4"], 6, "dist.tp=4 does not divide the 6 processes"),
        (["dist.strategy=ddp", "dist.tp=2"], 4, "set dist.strategy=fsdp or auto (it is ddp)"),
        (["dist.strategy=fsdp", "dist.tp=2", "dist.replicate=2"], 4,
         "dist.replicate with dist.tp=2: not supported"),
        (["dist.strategy=fsdp", "dist.tp=2", "train.compile=on"], 4,
         "train.compile=on with dist.tp=2: not supported"),
    ],
)  # fmt: skip
def test_a_layout_tensor_parallelism_cannot_take_is_one_line(overrides, world, said):
    message = layout_error(*overrides, world=world)
    assert said in message and "\n" not in message, message


def test_a_recipe_without_a_plan_refuses_dist_tp():
    message = layout_error("dist.strategy=fsdp", "dist.tp=2", world=2, recipe="digits")
    assert "recipe 'digits' declares no tensor-parallel plan" in message, message


def test_check_refuses_heads_that_do_not_divide_before_any_process_starts(tmp_path):
    """--check (what every launch target runs first) says it in one line, exit 2."""
    check = ["--check", "3", "dist.strategy=fsdp", "dist.tp=3", f"run.root={tmp_path}"]
    out = engine_process("gpt", *check, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "dist.tp=3 does not divide model.n_head=4" in lines[0], lines
    assert not list(tmp_path.iterdir())


def test_the_1b_layout_renders_and_checks_on_a_login_node(tmp_path):
    """make train RECIPE=gpt CONFIG=1b GPUS=8 ARGS=dist.tp=4 where no GPU is visible: the
    torchrun command of 8 processes and a frozen request that holds dist.tp=4; a tp that
    does not divide the 8 processes is one line and starts nothing. (A corpus of its own:
    the built-in one holds fewer samples than 1b's batch, which the check refuses.)"""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"0123456789abcdef" * 2**17)  # 2 MiB: 1b's batch of 1024-byte blocks
    login = {"CUDA_VISIBLE_DEVICES": "", "RECIPE": "gpt", "CONFIG": "1b", "GPUS": "8"}
    out = launch("train", **login, ARGS=f"dist.tp=4 data.path={corpus}", DRY_RUN="1", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--nproc_per_node=8" in out.stdout and "--resolved" in out.stdout, out.stdout
    assert "dist.tp=4" in out.stderr, out.stderr  # the note: what the request resolved from
    refused = launch("train", **login, ARGS="dist.tp=3", DRY_RUN="1", timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "dist.tp=3 does not divide the 8 processes of this run" in refused.stderr


def test_a_batch_is_split_over_the_data_parallel_groups_and_said_so():
    """8 processes at dist.tp=2 are 4 data-parallel groups: the global batch divides by 4."""
    from engine.catalog import load_config
    from engine.cli import preflight

    tp = ["dist.strategy=fsdp", "dist.tp=2", "train.micro_batch_size=2"]
    cfg, recipe = load_config("gpt", [*tp, "train.batch_size=8"])
    preflight(cfg, 8, recipe=recipe)  # 8 over 4 groups: 2 each
    cfg, recipe = load_config("gpt", [*tp, "train.batch_size=6"])
    with pytest.raises(ConfigError, match=r"does not divide over 4 data-parallel groups"):
        preflight(cfg, 8, recipe=recipe)
