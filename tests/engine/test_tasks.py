"""The tasks' losses and metrics: sums over their units, so that dividing by the global count
gives the same number however a batch is split."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.catalog import load_config
from engine.config import ConfigError, MixConfig, TrainConfig
from engine.lifecycle import train
from engine.tasks import IGNORE, Classification, NextToken, check_supported


def split_mean(task, output, target, parts: int) -> torch.Tensor:
    """The loss as the engine forms it from `parts` pieces: summed, over the global count."""
    count = task.count(target)
    total = len(target) if count is None else count
    pieces = zip(output.chunk(parts), target.chunk(parts), strict=True)
    return sum(task.train_loss(o, t, 0.0) for o, t in pieces) / total


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), parts=st.sampled_from([1, 2, 4]))
def test_next_token_loss_is_the_mean_over_counted_tokens_however_split(seed, parts):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 6, 11, generator=g)
    target = torch.randint(0, 11, (4, 6), generator=g)
    target[torch.rand(4, 6, generator=g) < 0.3] = IGNORE  # padding counts for nothing
    target[0, 0] = 3  # at least one counted token
    kept = target != IGNORE
    expected = F.cross_entropy(logits[kept], target[kept])
    assert torch.allclose(split_mean(NextToken(), logits, target, parts), expected, atol=1e-6)
    assert NextToken().count(target) == kept.sum()


def test_next_token_evaluation_sums_per_sample_and_derives_perplexity():
    task = NextToken()
    logits = torch.randn(3, 5, 7)
    target = torch.randint(0, 7, (3, 5))
    target[2, 3:] = IGNORE
    sums = task.eval_sums(logits, target)
    assert sums["count"].tolist() == [5, 5, 3]
    mean = sums["loss"].sum() / sums["count"].sum()
    kept = target != IGNORE
    assert torch.allclose(mean.float(), F.cross_entropy(logits[kept], target[kept]), atol=1e-6)
    derived = task.derived({"loss": float(mean)})
    assert math.isclose(derived["perplexity"], math.exp(mean))
    assert math.isclose(derived["bits_per_token"], float(mean) / math.log(2))


def test_classification_counts_samples_and_reports_top_k():
    task = Classification()
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 3.0, 2.0]])
    target = torch.tensor([0, 2])
    assert task.count(target) is None  # one per sample: the global batch, no collective
    sums = task.eval_sums(logits, target)
    assert sums["top1"].tolist() == [1.0, 0.0] and sums["top5"].tolist() == [1.0, 1.0]
    assert torch.allclose(split_mean(task, logits, target, 2), F.cross_entropy(logits, target))
    soft = F.one_hot(target, 3).float()  # mixup/cutmix targets are probabilities
    assert torch.allclose(task.train_loss(logits, soft, 0.0), task.train_loss(logits, target, 0.0))


# ---------------------------------------------------------------- what a task supports


class Regression:
    """A recipe's own task, declaring nothing beyond its loss (a mean squared error)."""


def test_a_task_refuses_a_feature_it_does_not_declare_in_one_line_naming_it():
    smoothing = TrainConfig(label_smoothing=0.1)
    with pytest.raises(ConfigError) as refused:
        check_supported(Regression(), smoothing, MixConfig())
    assert str(refused.value) == (
        "train.label_smoothing=0.1: the regression task has no classes to smooth; leave it 0"
    )
    with pytest.raises(ConfigError, match=r"^mix\.mixup_alpha=0\.2: the regression task "):
        check_supported(Regression(), TrainConfig(), MixConfig(mixup_alpha=0.2))
    with pytest.raises(ConfigError, match=r"^mix\.cutmix_alpha=1: the next-token task "):
        check_supported(NextToken(), TrainConfig(), MixConfig(cutmix_alpha=1.0))
    check_supported(NextToken(), smoothing, MixConfig())  # smoothing over the vocabulary
    check_supported(Classification(), smoothing, MixConfig(mixup_alpha=0.2, cutmix_alpha=1.0))
    check_supported(Regression(), TrainConfig(), MixConfig())  # nothing asked: nothing refused


def test_a_run_asking_its_task_for_an_unsupported_feature_stops_before_its_run_directory(
    tmp_path,
):
    cfg, recipe = load_config(
        "gpt", ["device=cpu", "log.wandb=off", f"run.root={tmp_path}", "mix.mixup_alpha=0.2"]
    )
    with pytest.raises(ConfigError, match=r"^mix\.mixup_alpha=0\.2: the next-token task"):
        train(cfg, recipe)
    assert list(tmp_path.iterdir()) == []
