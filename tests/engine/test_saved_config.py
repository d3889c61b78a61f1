"""A run directory's config.yaml holds the config that was asked for, not what this machine
made of it: `device: auto` (asked, or the default) stays `auto`, so the same file resumes or
reruns the run on a machine with other devices. The device the run resolved is recorded in
env.json instead. Both runs here are in this process (engine.train.train, engine.setup)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from engine import distributed as D
from engine import train
from engine.catalog import load_config
from engine.setup import setup

QUIET = ["log.wandb=off", "log.progress=off", "train.max_steps=1"]


@pytest.fixture(autouse=True)
def backend_flags():
    """train() and setup() set global flags (TF32, cuDNN, deterministic algorithms): restored
    afterwards, for the tests that run next in this process."""
    saved = (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
    )
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:3]
    torch.backends.cudnn.deterministic = saved[3]
    torch.use_deterministic_algorithms(saved[4])


def saved_files(run_dir: Path) -> tuple[dict, dict]:
    """(config.yaml, env.json) of a run directory."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return config, json.loads((run_dir / "env.json").read_text())


def test_a_run_started_without_a_device_saves_device_auto(tmp_path):
    cfg, recipe = load_config("digits", [*QUIET, f"run.root={tmp_path}", "run.name=r"])
    assert cfg.device == "auto"  # the default: what was asked
    assert train.train(cfg, recipe) == 0
    config, env = saved_files(tmp_path / "digits" / "r")
    assert config["device"] == "auto"
    assert env["device"] != "auto"  # what it resolved to ("cpu", "cuda:0") is env.json's


def test_device_auto_asked_for_is_saved_as_auto_whatever_it_resolves_to(tmp_path):
    overrides = [*QUIET, f"run.root={tmp_path}", "run.name=r", "device=auto"]
    cfg, recipe = load_config("digits", overrides)
    denv = D.DistEnv()
    run = setup(cfg, recipe, denv, D.pick_device(cfg.device, denv))
    try:
        config, env = saved_files(run.run_dir)
    finally:
        run.tracker.close()
        run.close()
    assert str(run.device) == env["device"] != "auto"
    assert config["device"] == "auto"
