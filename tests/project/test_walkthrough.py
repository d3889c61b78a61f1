"""The README's first run as a newcomer types it: its make commands, as written, in a copy of
the checkout (runs/ and the export land there, never in this checkout's runs/), then its
Python lines; and `load_model`, which those lines use, rebuilds every recipe's model as the
engine evaluates it, from a run's config.yaml and an export."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import catalog, export, export_graph
from engine.config import ConfigError
from engine.weights import load_model
from tests.helpers import REPO, launch_env, records
from tests.recipes.tiny_settings import tiny_overrides

README = REPO / "README.md"
SECTION = "## A first run, in ten minutes"
STAMP = ".venv/.installed-lock"  # the Makefile's venv stamp: the copy's venv is this one's


def walkthrough() -> tuple[list[str], str]:
    """(the section's shell commands, comments dropped; its Python block)."""
    section = README.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    commands = [line.split("  #")[0].strip() for line in bash.splitlines() if line.strip()]
    return commands, re.search(r"```python\n(.*?)```", section, re.S)[1]


def checkout_copy(root: Path) -> Path:
    """The checkout's files (tracked, and new ones not ignored), their times kept so that
    make finds the venv up to date, and this checkout's venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    (root / ".venv").symlink_to(Path(sys.prefix))
    return root


@pytest.mark.slow  # four make commands, each a fresh interpreter or two
def test_the_readme_s_first_run_works_as_written(tmp_path):
    commands, python = walkthrough()
    assert [shlex.split(c)[:2] for c in commands] == [
        ["make", "train"], ["make", "train"], ["make", "eval"], ["make", "export"],
    ]  # fmt: skip
    copy = checkout_copy(tmp_path / "checkout")
    env = launch_env(MAKEFLAGS=f"-o {STAMP}")
    said = []
    for command in commands:
        done = subprocess.run(  # the words a shell would pass
            shlex.split(command), cwd=copy, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (command, done.stderr[-2000:])
        said.append(done.stdout + done.stderr)
    run = copy / "runs" / "digits" / "walk"
    assert "stopped at step 30" in said[0] and "resuming from" in said[1], said[1][-2000:]
    steps = [r["step"] for r in records(copy / "runs", "walk", "train")]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # resumed, no step twice
    final = records(copy / "runs", "walk", "eval")[-1]
    scored = json.loads(next(run.glob("checkpoints/*.eval.json")).read_text())["metrics"]
    assert scored == {k: final[k] for k in scored} and "top1" in scored  # make eval: the same
    assert (copy / "walk.pt").is_file()

    shown = subprocess.run(
        [sys.executable, "-c", python], cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr[-2000:]
    model = load_model(run, copy / "walk.pt")
    with torch.no_grad():
        probabilities = model(torch.zeros(1, 1, 8, 8)).softmax(1)
    assert shown.stdout.strip() == str(probabilities)  # what the README's lines print


@pytest.mark.slow  # a short run of each recipe, the image ones with their example files
@pytest.mark.parametrize("recipe", catalog.available())
def test_load_model_rebuilds_the_model_the_engine_evaluates(tmp_path, train_here, recipe):
    """Every recipe's default config with its tiny settings: two steps, exported as a plain
    .pt, loaded by load_model from the run's config.yaml: the outputs on held-out samples
    are the engine's own model's (built as make eval builds it), bit for bit."""
    train_here(tmp_path, "two", *tiny_overrides(recipe, tmp_path / "data"),
               "train.max_steps=2", recipe=recipe)  # fmt: skip
    run = tmp_path / recipe / "two"
    assert export.main([str(run), str(tmp_path / "w.pt")]) == 0
    model = load_model(run, tmp_path / "w.pt")
    assert not model.training
    tensors = torch.load(tmp_path / "w.pt", weights_only=True)
    with export_graph.served([run], None, tensors, recipe) as served:
        x = export_graph.samples(served.run)
        with torch.no_grad():
            assert torch.equal(model(x), served.model(x))
    with torch.no_grad():  # the run folder alone: its newest checkpoint, the same weights
        assert torch.equal(load_model(run)(x), model(x))


def test_load_model_says_what_does_not_fit_in_one_line(tmp_path, train_here):
    train_here(tmp_path, "one", "train.max_steps=1")
    run = tmp_path / "digits" / "one"
    with pytest.raises(ConfigError, match="not found: give a run folder or its config.yaml"):
        load_model(tmp_path / "nowhere")
    tensors = torch.load(export_path(tmp_path, run), weights_only=True)
    tensors.pop(next(iter(tensors)))
    torch.save(tensors, tmp_path / "short.pt")
    with pytest.raises(ConfigError, match=r"1 tensor\(s\) missing, 0 unexpected"):
        load_model(run, tmp_path / "short.pt")


def export_path(tmp_path: Path, run: Path) -> Path:
    out = tmp_path / "w.pt"
    assert export.main([str(run), str(out)]) == 0
    return out
