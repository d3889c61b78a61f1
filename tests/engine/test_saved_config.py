"""A run directory's config.yaml holds the config that was asked for, not what this machine
made of it: `device: auto` (asked, or the default) stays `auto`, so the same file resumes or
reruns the run on a machine with other devices. The device the run resolved is recorded in
env.json instead. Both runs here are in this process (engine.lifecycle.train, engine.assemble)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine import distributed as D
from engine import lifecycle
from engine.assemble import setup
from engine.catalog import load_config

QUIET = ["log.wandb=off", "log.progress=off", "train.max_steps=1"]


pytestmark = pytest.mark.usefixtures("restore_backend_flags")  # tests/engine/conftest.py


def saved_files(run_dir: Path) -> tuple[dict, dict]:
    """(config.yaml, env.json) of a run directory."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return config, json.loads((run_dir / "env.json").read_text())


def test_a_run_started_without_a_device_saves_device_auto(tmp_path):
    cfg, recipe = load_config("digits", [*QUIET, f"run.root={tmp_path}", "run.name=r"])
    assert cfg.device == "auto"  # the default: what was asked
    assert lifecycle.train(cfg, recipe) == 0
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
        run.records.tracker.close()
        run.close()
    assert str(run.device) == env["device"] != "auto"
    assert config["device"] == "auto"
