"""train.label_smoothing reaches the loss: the tasks' training losses are torch's smoothed
cross entropy (checked against the formula too), and a real run with smoothing trains on a
different loss than one without, so dropping it anywhere from config to task is caught."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tasks import IGNORE, Classification, NextToken
from tests.helpers import final_weights, max_difference, records


def smoothed_sum(logits: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """Label smoothing written out: (1 - eps) x the target's -log p + eps x the mean -log p
    over the classes, summed over the rows whose target is not IGNORE."""
    logp = logits.double().log_softmax(dim=-1)
    kept = target != IGNORE
    logp, target = logp[kept], target[kept]
    nll = -logp.gather(-1, target[:, None]).squeeze(-1)
    uniform = -logp.mean(dim=-1)
    return ((1 - eps) * nll + eps * uniform).sum()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), eps=st.sampled_from([0.05, 0.1, 0.3, 0.9]))
def test_classification_loss_is_the_smoothed_cross_entropy_summed(seed, eps):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, 10, generator=g) * 3
    target = torch.randint(0, 10, (7,), generator=g)
    loss = Classification().train_loss(logits, target, eps)
    expected = F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(loss, smoothed_sum(logits, target, eps).float())
    unsmoothed = Classification().train_loss(logits, target, 0.0)
    assert not torch.allclose(loss, unsmoothed)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), eps=st.sampled_from([0.05, 0.1, 0.3, 0.9]))
def test_next_token_loss_is_the_smoothed_cross_entropy_over_counted_tokens(seed, eps):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, 11, generator=g) * 3
    target = torch.randint(0, 11, (3, 6), generator=g)
    target[torch.rand(3, 6, generator=g) < 0.3] = IGNORE
    target[0, 0] = 4  # at least one counted token
    loss = NextToken().train_loss(logits, target, eps)
    expected = F.cross_entropy(
        logits.flatten(0, 1),
        target.flatten(),
        ignore_index=IGNORE,
        label_smoothing=eps,
        reduction="sum",
    )
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(loss, smoothed_sum(logits, target, eps).float())
    assert not torch.allclose(loss, NextToken().train_loss(logits, target, 0.0))


@pytest.mark.slow
def test_a_run_with_label_smoothing_trains_on_the_smoothed_loss(tmp_path, train_here):
    """Same seed, data and weights: the first step's logged loss already differs, and so do
    the weights it trains to. With eps = 0.1 over 10 classes the smoothed loss of the first
    (near uniform) step is close to the plain one, but not equal."""
    short = ["train.max_steps=3", "log.every_steps=1"]
    train_here(tmp_path, "plain", *short)  # tests/engine/conftest.py
    train_here(tmp_path, "smooth", *short, "train.label_smoothing=0.1")
    plain = records(tmp_path, "plain", "train")
    smooth = records(tmp_path, "smooth", "train")
    assert [r["step"] for r in plain] == [r["step"] for r in smooth] == [1, 2, 3]
    assert smooth[0]["loss"] != plain[0]["loss"], (smooth[0], plain[0])
    assert max_difference(final_weights(tmp_path, "smooth"), final_weights(tmp_path, "plain")) > 0
