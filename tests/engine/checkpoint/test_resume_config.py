"""Resuming compares the checkpoint's config with the new one (check_config_drift): a change
that alters the run is refused, one that keeps its guarantees is allowed and said. Two kinds
of key need it key by key: dist.sync_bn, in the otherwise resume-safe dist section, is another
computation and is refused; in the train section only the keys declared safe (length,
micro-batching, speed options) may change, not the batch, the loss or the precision.

test_checkpoint.py's test of config_changes changes no dist key and no train key but
train.epochs, so it cannot tell these apart; here the digits recipe's real config is
resumed with one override at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.catalog import load_config
from engine.checkpoint.state import check_config_drift
from engine.config import ConfigError
from engine.tracking import redact

# Each changes what the run computes: refused on resume.
REFUSED = [
    "dist.sync_bn=true",
    "train.batch_size=128",
    "train.label_smoothing=0.1",
    "train.grad_clip=1.0",
    "train.amp=bf16",
]
# Each keeps the run's guarantees: allowed on resume.
ALLOWED = [
    "train.epochs=7",
    "train.max_steps=40",
    "train.stop_at_step=3",
    "train.micro_batch_size=16",
    "train.compile=on",
    "train.nan_policy=skip",
    "dist.timeout_s=60",
    "dist.strategy=ddp",
]


def resume_with(tmp_path: Path, override: str) -> None:
    """check_config_drift for a run resumed with `override` from a checkpoint that was
    written without it."""
    base = [f"run.root={tmp_path}", "run.name=r", "device=cpu"]
    saved, _ = load_config("digits", base)
    cfg, recipe = load_config("digits", [*base, override])
    source = (tmp_path / "step-00000005.pt", {"config": redact(saved.to_dict())})
    check_config_drift(cfg, recipe, source, is_main=True)


def changed(override: str) -> str:
    key, _ = override.split("=", 1)
    return key


@pytest.mark.parametrize("override", REFUSED)
def test_a_change_that_alters_the_run_is_refused_on_resume(tmp_path, override):
    with pytest.raises(ConfigError, match=rf"another config \({changed(override)} "):
        resume_with(tmp_path, override)


@pytest.mark.parametrize("override", ALLOWED)
def test_a_change_that_keeps_the_run_is_allowed_and_said(tmp_path, override, capsys):
    resume_with(tmp_path, override)
    said = capsys.readouterr().err
    assert "resuming with changed settings that keep the run's guarantees: " in said
    assert f"{changed(override)} " in said
