import copy
import math

import pytest
import torch
from torch import nn

from engine.config import SchedConfig
from engine.optim import grad_norm_, lr_factor
from tests.helpers import final_weights, records, run_dir, run_engine, same_weights


def test_warmup_then_cosine_counts_optimizer_steps():
    cfg = SchedConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, 110, cfg) == pytest.approx(0.1)
    assert lr_factor(9, 110, cfg) == pytest.approx(1.0)
    assert lr_factor(60, 110, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(110, 110, cfg) == pytest.approx(0.1)


def test_step_schedule():
    cfg = SchedConfig(name="step", milestones=[5, 8], gamma=0.5)
    assert [lr_factor(s, 10, cfg) for s in (0, 4, 5, 7, 8, 9)] == [1, 1, 0.5, 0.5, 0.25, 0.25]


@pytest.mark.parametrize("max_norm", [0.0, 0.05, 100.0])  # none, clipping, under the limit
def test_the_short_gradient_norm_is_the_library_s_bit_for_bit(max_norm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    twin, x = copy.deepcopy(model), torch.randn(4, 7)
    for m in (model, twin):
        m(x).pow(2).sum().backward()
    norm = grad_norm_(list(model.parameters()), max_norm, plain=True)
    if max_norm:
        expected = nn.utils.clip_grad_norm_(twin.parameters(), max_norm, foreach=True)
    else:
        expected = nn.utils.get_total_norm([p.grad for p in twin.parameters()], foreach=True)
    assert torch.equal(norm, expected)
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


@pytest.mark.slow
def test_adamw_step_schedule_clipping_bf16_and_deterministic_run_on_cpu(tmp_path, train_here):
    train_here(  # tests/engine/conftest.py
        tmp_path,
        "opts",
        "optim.name=adamw",
        "optim.lr=0.01",
        "sched.name=step",
        "sched.milestones=[5]",
        "sched.gamma=0.1",
        "sched.warmup_steps=0",
        "train.grad_clip=0.5",
        "train.amp=bf16",
        "deterministic=true",
        "train.max_steps=10",
        "log.every_steps=1",
    )
    lrs = {r["step"]: r["lr"] for r in records(tmp_path, "opts", "train")}
    # lr logged after step s is the one the next step uses
    assert lrs[4] == pytest.approx(0.01) and lrs[5] == pytest.approx(0.001)
    assert all(math.isfinite(r["loss"]) for r in records(tmp_path, "opts", "train"))


@pytest.mark.slow
def test_resume_from_an_explicit_checkpoint_path(tmp_path, train_here, capsys):
    common = ["train.max_steps=12", "ckpt.every_steps=4", "ckpt.keep=10"]
    train_here(tmp_path, "source", *common)  # tests/engine/conftest.py
    middle = run_dir(tmp_path, "source") / "checkpoints" / "step-00000004.pt"
    capsys.readouterr()
    train_here(tmp_path, "fork", *common, f"resume={middle}")
    assert f"resuming from {middle}" in capsys.readouterr().err
    assert same_weights(final_weights(tmp_path, "fork"), final_weights(tmp_path, "source"))


@pytest.mark.slow
def test_compiled_model_trains_and_checkpoints_bare_weights(tmp_path):
    run_engine(
        tmp_path,
        "compiled",
        "train.compile=true",
        "train.max_steps=5",
        "log.every_steps=1",
        timeout=600,
    )
    weights = final_weights(tmp_path, "compiled")
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in weights)
    losses = [r["loss"] for r in records(tmp_path, "compiled", "train")]
    assert len(losses) == 5 and all(map(math.isfinite, losses))
