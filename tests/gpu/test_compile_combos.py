"""torch.compile in the combinations no other test runs: DDP with static_graph, FSDP2 with
each block compiled before it is sharded, activation checkpointing inside the compiled model,
bf16 autocast with channels_last, and evaluation's separately compiled model (run.net.eval_model).

Each test assembles two runs through the engine's own set-up (engine.assemble.setup) from the
same config and seed, one with train.compile=on and one with train.compile=off, trains both
for a few optimizer steps with engine.train.train_step, and compares the losses step by step
and the final weights, within a tolerance stated beside it. Each also checks that the
combination really happened (the compiled module and how much of the model its graphs hold,
DDP's static graph, the FSDP units and their compiled blocks, activations recomputed rather
than kept, the layout and the precision), so that none passes with compilation or the feature
silently off.

On a CUDA device compilation is the real one (inductor). Without one, GPU_TESTS_ON_CPU=1 runs
the same tests on the CPU (conftest keeps tests marked gpu(cpu_stand_in=True)), with gloo for
the process group and dynamo with the aot_eager backend (the graphs are captured, traced
through AOT autograd and partitioned as with inductor, without minutes of C++ compilation);
the tolerances and checks are the same. DDP and FSDP run in this process, in a process group
of one: what the single GPU allows."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engine import distributed as D
from engine import parallel as P
from engine.assemble import setup
from engine.catalog import load_config
from engine.evaluate import evaluate, predict
from engine.parallel import Strategy
from engine.train import train_step
from recipes.cifar10.example import write_example

pytestmark = pytest.mark.gpu(cpu_stand_in=True)

CUDA = torch.cuda.is_available()
# The compiler under test: inductor on CUDA; on the CPU stand-in, a backend that costs seconds.
CPU_BACKEND = os.environ.get("GPU_TESTS_CPU_BACKEND", "aot_eager")
STEPS = 4

# Both runs of a comparison: fp32 without TF32 (TF32's 10-bit mantissa would be the largest
# difference between two kernels' sums) and without cuDNN's autotuner (it may pick another
# kernel in each run); no warmup and a constant rate, so every step moves the weights; SGD,
# whose update is linear in the gradient (Adam's first updates are lr x sign(g), so a
# gradient near zero that changes sign with the order of a sum would move a weight by 2 x lr).
COMMON = [
    "log.wandb=off",
    "log.progress=off",
    f"device={'cuda' if CUDA else 'cpu'}",
    "train.amp=off",
    "train.tf32=false",
    "train.cudnn_benchmark=false",
    f"train.max_steps={STEPS}",
    "sched.name=constant",
    "sched.warmup_steps=0",
    "loader.num_workers=0",
    "optim.name=sgd",
    "optim.momentum=0.9",
    "optim.weight_decay=0",
]
# The gpt recipe's byte-level model (data: Python's own documentation, nothing to write),
# shrunk to one that compiles in seconds.
GPT = [
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.context=16",
    "model.dropout=0.0",  # compiled dropout draws other masks than eager's
    "data.block_size=16",
    "data.eval_fraction=0.01",
    "train.batch_size=8",
    "optim.lr=0.5",
    "eval.batch_size=16",
]
# cifar10's airbench net (convolutions, batch norm, max pool, GELU) at the tiny widths, on the
# recipe's own example data (40 training and 20 test images in the official format).
CIFAR = [
    "model.arch=airbench",
    "model.widths=[8,16,16]",
    "model.bias_lr_scale=1",
    "train.batch_size=8",
    "train.channels_last=true",
    "optim.lr=0.05",
    "eval.batch_size=8",  # 20 test images: the last batch of 4 is padded to 8
]

# How close a compiled run stays to the eager one: the loss of each step relative to eager's,
# and the final weights' distance from eager's relative to how far eager's steps moved them.
# fp32: the compiled kernels sum in another order (fused reductions, layer and batch norm
# statistics, cuBLAS and cuDNN called on other shapes), a relative difference of about 1e-6 per
# operation that four SGD steps carry into the weights without amplifying it much (measured
# with inductor on a CPU: 2e-7 of the update for gpt). 1e-4 on the loss and 1e-3 on the
# weights leave orders of magnitude, while a wrong gradient (a block left out, a stale
# bucket, a recomputation from other inputs) is off by tens of percent.
FP32 = {"loss": 1e-4, "weights": 1e-3}
# The same for a network with max pooling: each window's gradient goes to its largest element,
# and two nearly equal elements (the example images are uint8, so equal neighbours are common)
# may swap under float noise and send that gradient elsewhere (measured on a CPU: 2e-4).
FP32_POOLED = {"loss": 1e-4, "weights": 1e-2}
# bf16: eager rounds every operation's result to bf16's 8-bit mantissa (2**-8 = 0.4%), inductor
# keeps a fused kernel's intermediates in fp32 and rounds once, so activations differ by about
# a percent and the gradients by a few (measured on a CPU: 2e-4 on the loss, 0.025 on the
# weights); a wrong result is still several times further.
BF16 = {"loss": 3e-2, "weights": 0.2}


@pytest.fixture(autouse=True)
def compiler(monkeypatch):
    """Dynamo's caches and counters cleared for each test; on the CPU stand-in, every
    torch.compile the engine calls (the whole model, each block, the eval model) goes to the
    cheap backend."""
    if not CUDA:
        if os.environ.get("GPU_TESTS_ON_CPU") != "1":
            pytest.fail("a gpu test without CUDA runs only with GPU_TESTS_ON_CPU=1")
        compile_ = functools.partial(torch.compile, backend=CPU_BACKEND)
        monkeypatch.setattr(torch, "compile", compile_)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@pytest.fixture
def backend_flags():
    """setup() sets global backend flags (TF32, cuDNN's autotuner): restored afterwards."""
    saved = (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:]


@pytest.fixture
def one_process_group(backend_flags):
    """A process group of one, on the backend the engine picks for the device (D.init joins a
    group only with several processes, so it is joined here as D.init would)."""
    device = D.pick_device("auto", D.DistEnv())
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar10")
    write_example(root)
    return root


def build(tmp_path, recipe: str, compiled: bool, *overrides: str):
    """A run as `python -m engine.train RECIPE ...` assembles it, in this process and without
    a run directory (setup's records=False)."""
    mode = "on" if compiled else "off"
    cfg, recipe_ = load_config(
        recipe, [*COMMON, f"run.root={tmp_path}", *overrides, f"train.compile={mode}"]
    )
    cfg.run.name = f"compile-{mode}"
    denv = D.DistEnv()
    return setup(cfg, recipe_, denv, D.pick_device(cfg.device, denv), records=False)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor on the CPU (an FSDP shard gathered)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().float().cpu()


def weights(run) -> torch.Tensor:
    return torch.cat([full(p).flatten() for p in run.net.trainable])


def train(run) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """(the loss of each of the run's steps, the weights before, the weights after), through
    the engine's train_step on the run's own loader."""
    before = weights(run)
    plan = run.feed.sampler.plan
    run.feed.sampler.set_epoch(0, 0)
    batches = iter(run.feed.loader)
    losses = []
    for _ in range(run.progress.total_steps):
        micro = [next(batches) for _ in range(plan.accum_steps)]
        loss, _ = train_step(run, micro)
        run.progress.step += 1
        run.progress.position += plan.global_batch
        losses.append(loss.item())
    return losses, before, weights(run)


def assert_matches_eager(compiled, eager, tolerance: dict) -> None:
    """Both runs started from the same weights, trained, and stayed within the tolerance:
    per-step losses relative to eager's, the final weights' difference relative to how far
    eager's training moved them."""
    losses, start, end = compiled
    eager_losses, eager_start, eager_end = eager
    assert torch.equal(start, eager_start), "the two runs did not start from the same weights"
    assert len(losses) == len(eager_losses) == STEPS
    assert all(map(torch.isfinite, torch.tensor(losses)))
    moved = (eager_end - eager_start).norm()
    assert moved > 1e-3 * eager_start.norm(), "training barely moved the weights"
    for step, (a, b) in enumerate(zip(losses, eager_losses, strict=True), 1):
        assert abs(a - b) <= tolerance["loss"] * abs(b), f"step {step}: {a} vs eager {b}"
    drift = ((end - eager_end).norm() / moved).item()
    assert drift <= tolerance["weights"], f"final weights {drift:.2e} of the update apart"


def graphs(counters) -> int:
    return counters["stats"]["unique_graphs"]


def weighted_layers(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if not list(m.children()) and list(m.parameters()))


def assert_captured(counters, module: nn.Module) -> None:
    """Dynamo's graphs hold the module's computation, not a piece of it: they call at least
    once per layer that holds weights. A model left to eager but for a leaf (a graph break
    at its top, or a top-level frame dynamo skips, e.g. nn.Sequential.forward entered from
    DDP's eager forward) captures a handful of calls."""
    assert graphs(counters) >= 1, "nothing was compiled"
    calls, layers = counters["stats"]["calls_captured"], weighted_layers(module)
    assert calls >= layers, f"{calls} calls captured for {layers} layers with weights"


def test_ddp_with_static_graph_compiled_trains_like_eager_ddp(
    tmp_path, one_process_group, compiler, monkeypatch
):
    # In one process the engine trains dist.strategy=ddp without the wrapper; DDP over a
    # group of one is what is under test.
    monkeypatch.setattr(P, "resolve_strategy", lambda requested, denv: Strategy("ddp"))
    options = [*GPT, "dist.strategy=ddp", "dist.static_graph=true"]
    eager_run = build(tmp_path, "gpt", False, *options)
    assert isinstance(eager_run.model, nn.parallel.DistributedDataParallel)
    eager = train(eager_run)
    assert graphs(compiler) == 0
    run = build(tmp_path, "gpt", True, *options)
    # the bare model compiled in place, inside DDP (engine.parallel.wrap says why)
    ddp = run.net.model
    assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is run.net.bare
    assert run.net.bare._compiled_call_impl is not None and run.net.eval_model is run.net.bare
    assert ddp.static_graph and eager_run.model.static_graph
    compiled = train(run)
    assert_captured(compiler, run.net.bare)
    assert_matches_eager(compiled, eager, FP32)


def test_ddp_compiles_a_model_whose_forward_is_torchs_own_whole(
    tmp_path, one_process_group, compiler, monkeypatch, cifar_root
):
    """airbench is an nn.Sequential: compiled from outside DDP, dynamo would skip its forward
    (torch's code) after the graph break at DDP's forward and capture one leaf."""
    monkeypatch.setattr(P, "resolve_strategy", lambda requested, denv: Strategy("ddp"))
    options = [*CIFAR, f"data.root={cifar_root}", "dist.strategy=ddp"]
    eager = train(build(tmp_path, "cifar10", False, *options))
    run = build(tmp_path, "cifar10", True, *options)
    assert isinstance(run.net.bare, nn.Sequential) and run.net.model.module is run.net.bare
    compiled = train(run)
    assert_captured(compiler, run.net.bare)
    assert_matches_eager(compiled, eager, FP32_POOLED)


def test_fsdp_with_each_block_compiled_trains_like_eager_fsdp(
    tmp_path, one_process_group, compiler, monkeypatch
):
    # In one process the engine trains dist.strategy=fsdp unsharded (strategy "none", so
    # that the run can go back to several processes); the sharded path is what is under
    # test, over a mesh of one process.
    monkeypatch.setattr(P, "resolve_strategy", lambda requested, denv: Strategy("fsdp", True))
    options = [*GPT, "dist.strategy=fsdp"]
    eager_run = build(tmp_path, "gpt", False, *options)
    eager = train(eager_run)
    assert graphs(compiler) == 0
    run = build(tmp_path, "gpt", True, *options)
    blocks = list(run.net.bare.blocks)
    assert (
        run.net.model is run.net.bare and run.net.eval_model is run.net.bare
    )  # compiled per block only
    assert isinstance(run.net.bare, FSDPModule) and all(isinstance(b, FSDPModule) for b in blocks)
    assert all(isinstance(p, DTensor) for p in run.net.bare.parameters())
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert run.net.bare._compiled_call_impl is None
    compiled = train(run)
    # every block runs the same code: one graph may serve all of them
    assert_captured(compiler, blocks[0])
    assert_matches_eager(compiled, eager, FP32)


def saved_bytes(run) -> int:
    """What one training forward pass keeps for the backward pass (bytes of the tensors
    autograd saves: the compiled graph's saved activations too)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    x, _ = run.to_device(*next(iter(run.feed.loader))[:2], run.feed.train_data)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), run.autocast():
        run.net.model(x).float().sum().backward()
    run.opt.optimizer.zero_grad(set_to_none=True)
    return total


def test_activation_checkpointing_inside_the_compiled_model_trains_like_eager(tmp_path, compiler):
    options = [*GPT, "train.activation_checkpointing=true"]
    eager_run = build(tmp_path, "gpt", False, *options)
    eager = train(eager_run)
    run = build(tmp_path, "gpt", True, *options)
    assert isinstance(run.net.model, torch._dynamo.eval_frame.OptimizedModule)
    compiled = train(run)
    # The checkpointed blocks inside the one compiled graph, not run eagerly beside it (a
    # graph break around each block would also train, uncompiled).
    assert graphs(compiler) == 1 and not compiler["graph_break"], dict(compiler["graph_break"])
    assert_matches_eager(compiled, eager, FP32)
    # Recomputed, not kept, in both runs: without checkpointing each block keeps its attention
    # and its MLP's 4x-wide activations for the backward pass, with it little more than its
    # input (in eager a seventh of the bytes; compiled, a quarter to a seventh).
    keeping = saved_bytes(build(tmp_path, "gpt", False, *GPT))
    checkpointed, eager_checkpointed = saved_bytes(run), saved_bytes(eager_run)
    assert 0 < checkpointed < 0.5 * keeping and 0 < eager_checkpointed < 0.5 * keeping


def test_bf16_autocast_with_channels_last_compiled_trains_like_eager(
    tmp_path, cifar_root, compiler
):
    options = [*CIFAR, f"data.root={cifar_root}", "train.amp=bf16"]
    eager = train(build(tmp_path, "cifar10", False, *options))
    run = build(tmp_path, "cifar10", True, *options)
    assert run.opt.amp_dtype == torch.bfloat16 and run.net.layout == torch.channels_last
    assert isinstance(run.net.model, torch._dynamo.eval_frame.OptimizedModule)
    compiled = train(run)
    assert_captured(compiler, run.net.bare)
    convs = [m.weight for m in run.net.bare.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    x, _ = run.to_device(*next(iter(run.feed.loader))[:2], run.feed.train_data)
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    with run.autocast():
        assert run.net.model(x).dtype == torch.bfloat16
    assert_matches_eager(compiled, eager, BF16)


def test_the_separately_compiled_eval_model_evaluates_like_eager(tmp_path, cifar_root, compiler):
    options = [*CIFAR, f"data.root={cifar_root}"]
    eager_run = build(tmp_path, "cifar10", False, *options)
    eager = train(eager_run)
    run = build(tmp_path, "cifar10", True, *options)
    compiled = train(run)
    assert_captured(compiler, run.net.bare)
    assert_matches_eager(compiled, eager, FP32_POOLED)
    assert isinstance(run.net.eval_model, torch._dynamo.eval_frame.OptimizedModule)
    assert run.net.eval_model._orig_mod is run.net.bare and run.net.eval_model is not run.net.model
    assert eager_run.eval_model is eager_run.bare
    before = graphs(compiler)
    result, eager_result = (
        evaluate(run, run.net.eval_model),
        evaluate(eager_run, eager_run.eval_model),
    )
    assert graphs(compiler) == before + 1  # the eval model's own graph, at the padded size
    again = evaluate(run, run.net.eval_model)
    assert graphs(compiler) == before + 1  # the padded last batch compiled nothing more
    assert again["loss"] == pytest.approx(result["loss"], rel=1e-6)
    assert result["count"] == eager_result["count"] == len(run.feed.eval_data) == 20
    assert abs(result["loss"] - eager_result["loss"]) <= FP32["loss"] * eager_result["loss"]
    assert abs(result["top1"] - eager_result["top1"]) <= 1 / 20 + 1e-9  # a near tie may flip
    # The compiled eval model against the same weights in eager, on a padded batch (5 of 8).
    x, _ = run.to_device(*next(iter(run.feed.loader))[:2], run.feed.train_data)
    run.net.bare.eval()
    with torch.no_grad():
        logits, reference = predict(run, run.net.eval_model, x[:5])[:5], run.net.bare(x[:5])
    assert graphs(compiler) == before + 1
    assert logits.shape == reference.shape == (5, 10)
    assert (logits - reference).abs().max() <= FP32["loss"] * reference.abs().max()
