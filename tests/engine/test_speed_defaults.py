"""The speed defaults take effect, and each switch turns its default off: memory format,
fused/foreach optimizers, TF32 and cuDNN flags, compile (evaluation included), FLOPs per
sample and MFU, and the starvation warning."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from engine import distributed as D
from engine.assemble import setup
from engine.catalog import load_config
from engine.config import ConfigError, OptimConfig
from engine.evaluate import run_eval
from engine.optim import implementation
from engine.speed import datasheet_peak_tflops, flops_per_sample, memory_format
from engine.tracking import ProgressBar
from engine.train import train_epoch
from tests.helpers import records

QUIET = ["log.wandb=off", "log.progress=off", "device=cpu"]


@pytest.fixture
def build(tmp_path):
    """setup() in this process; the global backend flags it sets are restored afterwards."""
    saved = (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
    )
    runs = []

    def make(*overrides, recipe="digits"):
        cfg, recipe_ = load_config(recipe, [*QUIET, f"run.root={tmp_path}", *overrides])
        cfg.run.name = f"run{len(runs)}"
        run = setup(cfg, recipe_, D.DistEnv(), torch.device("cpu"))
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.records.tracker.close()
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:3]
    torch.use_deterministic_algorithms(saved[3])


def conv_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]


def test_convolutional_models_train_channels_last_by_default(build):
    run = build("train.max_steps=2")
    weights = conv_weights(run.net.bare)
    assert weights and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    seen = []
    for conv in (m for m in run.net.bare.modules() if isinstance(m, nn.Conv2d)):
        conv.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    train_epoch(run, ProgressBar(run.progress.total_steps, 0, "off", False))
    assert seen and all(x.is_contiguous(memory_format=torch.channels_last) for x in seen)
    # NHWC for real: with one channel (the digits input) both layouts coincide, with 32 not
    assert not all(x.is_contiguous() for x in seen)


def test_channels_last_switch_keeps_the_default_layout(build):
    run = build("train.channels_last=false")
    assert all(w.is_contiguous() for w in conv_weights(run.net.bare))
    assert not all(
        w.is_contiguous(memory_format=torch.channels_last) for w in conv_weights(run.net.bare)
    )


def test_models_without_2d_convolutions_keep_their_layout():
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert memory_format(mlp, channels_last=True) == torch.contiguous_format
    assert memory_format(nn.Conv2d(1, 1, 3), channels_last=True) == torch.channels_last


@pytest.mark.parametrize(
    "choice, fused, foreach",
    [
        ("auto", True, False),
        ("fused", True, False),
        ("foreach", False, True),
        ("loop", False, False),
    ],
)
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_optimizer_implementation_switch(build, name, choice, fused, foreach):
    run = build(f"optim.name={name}", f"optim.implementation={choice}")
    assert bool(run.opt.optimizer.defaults["fused"]) is fused
    assert bool(run.opt.optimizer.defaults["foreach"]) is foreach


def test_sharded_sgd_falls_back_from_fused_to_foreach():
    """FSDP's DTensor parameters have no fused SGD kernel (fused AdamW they have)."""
    sgd, adamw = OptimConfig(name="sgd"), OptimConfig(name="adamw")
    cpu = torch.device("cpu")
    assert implementation(sgd, cpu, sharded=True) == {"fused": False, "foreach": True}
    assert implementation(adamw, cpu, sharded=True) == {"fused": True, "foreach": False}
    with pytest.raises(ConfigError, match="optim.implementation=foreach"):
        implementation(OptimConfig(name="sgd", implementation="fused"), cpu, sharded=True)


def backend_flags() -> tuple:
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ((), ("high", True, True)),
        (("train.tf32=false",), ("highest", False, True)),
        (("train.cudnn_benchmark=false",), ("high", True, False)),
        (("deterministic=true",), ("highest", False, False)),  # both off, whatever the switches
    ],
)
def test_tf32_and_cudnn_benchmark_follow_their_switches_and_deterministic(
    build, overrides, expected
):
    torch.set_float32_matmul_precision("medium")  # neither value setup may leave
    build(*overrides)
    assert backend_flags() == expected


def test_compile_auto_is_off_on_cpu(build):
    run = build()
    assert run.net.model is run.net.bare and run.net.eval_model is run.net.bare


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile through dynamo with the eager backend: the graphs are captured and
    counted as with inductor, without minutes of C++ compilation on a CPU."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_compiled_model_is_used_for_evaluation_without_recompiling(build, eager_compile):
    run = build("train.compile=on", "train.max_steps=2", "eval.batch_size=256")
    assert isinstance(run.net.eval_model, torch._dynamo.eval_frame.OptimizedModule)
    assert run.net.eval_model._orig_mod is run.net.bare
    assert len(run.feed.eval_data) % 256, "the test needs a shorter last evaluation batch"
    train_epoch(run, ProgressBar(run.progress.total_steps, 0, "off", False))
    before = eager_compile["stats"]["unique_graphs"]
    progress = ProgressBar(run.progress.total_steps, 0, "off", False)
    first = run_eval(run, progress)
    # One new graph, for eval mode: the shorter last batch is padded to the batch size
    # rather than compiled again for its shape.
    assert eager_compile["stats"]["unique_graphs"] == before + 1
    second = run_eval(run, progress)
    assert eager_compile["stats"]["unique_graphs"] == before + 1
    assert first["count"] == len(run.feed.eval_data) and first["top1"] == second["top1"]
    bare_logits = run.net.bare.eval()(
        next(iter(run.feed.loader)).x[:4].contiguous(memory_format=torch.channels_last)
    )
    assert torch.isfinite(bare_logits).all()


def test_digits_flops_per_sample_are_counted_by_hand(build):
    """3 x the forward FLOPs; a 3x3 convolution costs 2 * c_in * c_out * 9 per output pixel."""
    assert build().records.speed.flops_per_sample == 0  # no peak on CPU: no MFU, nothing counted
    run = build("log.peak_tflops=1")
    conv = 2 * 9 * (1 * 32 * 64 + 32 * 32 * 64 + 32 * 64 * 16 + 64 * 64 * 16)
    assert (
        run.records.speed.flops_per_sample == 3 * (conv + 2 * 64 * 10)
        and run.records.speed.peak_flops == 1e12
    )
    cfg, recipe = load_config("imagenet", ["model.arch=resnet18", "model.num_classes=1000"])
    assert flops_per_sample(recipe, cfg) == pytest.approx(3 * 3.64e9, rel=0.01)  # 1.82 GMACs
    cfg.data.augment.train_size = 32  # a 1x1 last feature map: batch norm counts in eval mode
    assert flops_per_sample(recipe, cfg) == pytest.approx(3 * 3.64e9 / 49, rel=0.05)


@pytest.mark.slow
def test_mfu_and_starvation_warning_in_metrics(tmp_path, train_here, capsys):
    train_here(  # tests/engine/conftest.py
        tmp_path,
        "slow",
        "train.max_steps=12",
        "log.every_steps=3",
        "log.peak_tflops=0.001",
        "fault.data_delay_ms=30",
        "log.data_wait_warn=0.2",
    )
    said = capsys.readouterr().err
    warnings = [line for line in said.splitlines() if "waited for data" in line]
    assert len(warnings) == 1, said
    assert "loader.num_workers (now 0)" in warnings[0]
    train = records(tmp_path, "slow", "train")
    assert len(train) == 4 and all(r["data_wait"] > 0.2 for r in train[1:])
    flops = 3 * (2 * 9 * (32 * 64 + 32 * 32 * 64 + 32 * 64 * 16 + 64 * 64 * 16) + 2 * 64 * 10)
    for r in train:
        assert math.isclose(r["mfu"], r["samples_per_s"] * flops / 1e9, rel_tol=1e-9)
        assert "gpu_mem_gb" not in r  # CUDA only


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA H100", 0.0),  # which part is not said: no guess, no MFU
        ("NVIDIA H800", 0.0),
        ("NVIDIA GeForce RTX 4090", 0.0),
    ],
)
def test_a_gpus_peak_is_its_own_parts_not_a_namesakes(name, tflops):
    """A substring match gave every H100 and H200 the SXM part's 989 and overstated MFU."""
    assert datasheet_peak_tflops(name) == tflops
