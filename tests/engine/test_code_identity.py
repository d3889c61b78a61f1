"""A run names the code it ran (engine.codeid), and a resume over other code is refused in one
line unless run.allow_code_change says so, when the change is recorded in metrics.jsonl, the
summary and the report. The engine runs here from a git repository of its own, which the
test commits to between a run and its resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import git, git_checkout, run_engine

pytestmark = pytest.mark.slow  # trains in real processes


def engine_in(repo: Path, root: Path, *overrides: str, check: bool = True):
    env = helpers.engine_env(PYTHONPATH=str(repo))
    base = ["train.max_steps=8", "log.every_steps=2"]
    return run_engine(root, "r", *base, *overrides, cwd=repo, env=env, check=check)


def saved_code(run: Path) -> dict:
    return json.loads((run / "env.json").read_text())["code"]


def test_a_resume_over_other_code_stops_in_one_line_unless_allowed_then_it_is_recorded(
    tmp_path,
):
    repo, root = git_checkout(tmp_path / "repo"), tmp_path / "runs"
    run = root / "digits" / "r"
    first = git(repo, "rev-parse", "HEAD")
    engine_in(repo, root, "train.stop_at_step=4")
    assert saved_code(run) == {"commit": first, "dirty": False, "diff_sha256": None}

    train = repo / "engine" / "train.py"
    train.write_text(train.read_text() + "\n# a later change\n")
    refused = engine_in(repo, root, check=False)  # uncommitted changes alone
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert f"commit {first[:12]}, uncommitted changes none -> " in line, line

    git(repo, "commit", "-q", "-am", "a later change")
    second = git(repo, "rev-parse", "HEAD")
    before = (run / "metrics.jsonl").read_text()
    refused = engine_in(repo, root, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert f"commit {first[:12]} -> {second[:12]}" in line and "run.allow_code_change" in line
    assert (run / "metrics.jsonl").read_text() == before  # nothing written, nothing lost
    assert not (run / "summary.json").exists()

    allowed = engine_in(repo, root, "run.allow_code_change=true")
    assert f"commit {first[:12]} -> {second[:12]}" in allowed.stderr
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in records if r["kind"] == "code"]
    assert [(c["step"], c["from"]["commit"], c["to"]["commit"]) for c in changes] == [
        (4, first, second)
    ]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["code"]["commit"] == second == saved_code(run)["commit"]
    ckpt = helpers.final_checkpoint(root, "r")
    assert ckpt["code"]["commit"] == second  # what the next resume compares with

    report = helpers.launch("report", str(run))
    assert report.returncode == 0, report.stderr
    (md,) = run.parent.glob("*.md")  # beside the run
    text = md.read_text()
    assert "## Changes of code" in text and f"{first[:12]} -> {second[:12]}" in text, text
