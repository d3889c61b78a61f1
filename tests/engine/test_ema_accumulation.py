"""The EMA of the weights is updated once per optimizer step, not once per micro batch: with
gradient accumulation its update count is the number of optimizer steps, and its weights
are those of the same run without accumulation (up to float rounding)."""

import pytest
import torch

from tests.helpers import final_checkpoint

pytestmark = pytest.mark.slow

STEPS = 6
# GroupNorm has no batch statistics, so cutting the batch into micro batches changes nothing
# but the order of float sums. No warmup: every step is an average (n_averaged counts them).
RUN = [f"train.max_steps={STEPS}", "model.norm=group", "ema.decay=0.8", "ema.warmup_steps=0"]


def test_ema_with_accumulation_counts_optimizer_steps_and_matches_no_accumulation(
    tmp_path, train_here
):
    train_here(tmp_path, "whole", *RUN)  # tests/engine/conftest.py
    train_here(tmp_path, "accum", *RUN, "train.micro_batch_size=16")  # 64 / 16: 4 micro steps
    whole, accum = final_checkpoint(tmp_path, "whole"), final_checkpoint(tmp_path, "accum")
    assert whole["step"] == accum["step"] == STEPS
    assert int(whole["ema"]["n_averaged"]) == STEPS
    assert int(accum["ema"]["n_averaged"]) == STEPS  # once per optimizer step
    ema_whole, ema_accum = whole["ema"]["model"], accum["ema"]["model"]
    assert ema_whole.keys() == ema_accum.keys()
    for key in ema_whole:
        torch.testing.assert_close(ema_accum[key], ema_whole[key], msg=lambda m, k=key: f"{k}: {m}")
    # the average is not simply the last weights: it lags behind them
    assert any(not torch.equal(ema_accum[k], accum["model"][k]) for k in ema_accum)
