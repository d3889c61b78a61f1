"""What a run says as it trains (log.progress=plain), in this process: the step and evaluation
lines count epochs alike, from 1, while metrics.jsonl keeps `epoch`, the epochs completed."""

from __future__ import annotations

import re

import pytest

from engine import lifecycle
from engine.catalog import load_config
from tests.helpers import records

PLAIN = ["log.wandb=off", "log.progress=plain", "device=cpu", "log.every_steps=1"]


pytestmark = pytest.mark.usefixtures("restore_backend_flags")  # tests/engine/conftest.py


def said_epochs(err: str, kind: str) -> list[tuple[int, int]]:
    """(step, epoch) of each step line (kind "train") or evaluation line (kind "eval")."""
    pattern = (
        r"^step (\d+)/\d+ epoch (\d+) " if kind == "train" else r"^eval epoch (\d+) step (\d+):"
    )
    found = [re.match(pattern, line) for line in err.splitlines()]
    pairs = [tuple(map(int, m.groups())) for m in found if m]
    return pairs if kind == "train" else [(s, e) for e, s in pairs]


@pytest.mark.parametrize(
    "overrides, steps, evals, eval_records",
    [
        # two steps an epoch (1437 samples, 512 a step), two epochs: evaluated at each end
        (
            ["train.batch_size=512", "train.epochs=2"],
            [(1, 1), (2, 1), (3, 2), (4, 2)],
            [(2, 1), (4, 2)],
            [(2, 1), (4, 2)],
        ),
        # stopped by max_steps within the first epoch, and evaluated there
        (["train.max_steps=1"], [(1, 1)], [(1, 1)], [(1, 0)]),
    ],
)
def test_step_and_evaluation_lines_count_epochs_from_1(
    tmp_path, capsys, overrides, steps, evals, eval_records
):
    common = [*PLAIN, f"run.root={tmp_path}", "run.name=r", *overrides]
    cfg, recipe = load_config("digits", common)
    assert lifecycle.train(cfg, recipe) == 0
    err = capsys.readouterr().err
    assert said_epochs(err, "train") == steps, err
    assert said_epochs(err, "eval") == evals, err
    # the records keep the epochs completed: a step's before it, an evaluation's at it
    trained = [(r["step"], r["epoch"]) for r in records(tmp_path, "r", "train")]
    assert trained == [(step, epoch - 1) for step, epoch in steps]
    assert [(r["step"], r["epoch"]) for r in records(tmp_path, "r", "eval")] == eval_records
