"""The diabetes recipe: a regression task whose headline, rmse, is lower-is-better. One short run
in this process (the subject is what it trains) whose evaluations rise and fall: the best
checkpoints it keeps are its lowest, and `make eval`'s scoring of its final checkpoint is its
final evaluation. tests/recipes/test_every_config.py already trains its config two steps."""

import json

import numpy as np
import pytest
import torch

from engine import cli
from tests.helpers import QUIET, backend_flags, records, run_dir, set_backend_flags

pytestmark = pytest.mark.slow

# 354 training rows: 5 steps of 64 an epoch, an evaluation and a checkpoint after each. A
# constant, too high learning rate makes the held-out rmse rise and fall, so the lowest two
# are neither the newest two nor the highest; ckpt.keep=1 prunes their rolling checkpoints.
SETTINGS = [
    "train.epochs=6",
    "train.batch_size=64",
    "sched.name=constant",
    "optim.lr=0.1",
    "ckpt.best=2",
    "ckpt.keep=1",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, train_here):
    root = tmp_path_factory.mktemp("diabetes")
    train_here(root, "bounce", *SETTINGS, recipe="diabetes")
    return root


def test_the_best_checkpoints_are_the_lowest_rmse(run):
    evals = records(run, "bounce", "eval", "diabetes")
    lowest = sorted(evals, key=lambda r: (r["rmse"], r["step"]))[:2]
    newest = evals[-2:]
    assert {r["step"] for r in lowest} != {r["step"] for r in newest}, "rmse fell throughout"
    folder = run_dir(run, "bounce", "diabetes")
    summary = json.loads((folder / "summary.json").read_text())
    names = [f"step-{r['step']:08d}.pt" for r in lowest]
    assert summary["best_checkpoints"] == [
        {"step": r["step"], "rmse": r["rmse"], "path": f"best/{n}"}
        for r, n in zip(lowest, names, strict=True)
    ]
    assert sorted(p.name for p in (folder / "best").iterdir()) == sorted(names)
    assert summary["headline"] == "rmse" and summary["higher_is_better"] is False


def test_eval_of_the_run_equals_its_final_record(run, tmp_path):
    """`make eval CKPT=<run>` runs `python -m engine.train diabetes --config <run's config>
    --eval <run>`: here its main, in this process."""
    folder = run_dir(run, "bounce", "diabetes")
    out = tmp_path / "scored.json"
    argv = ["diabetes", "--config", str(folder / "config.yaml"), *QUIET]
    threads, saved = torch.get_num_threads(), backend_flags()
    torch.set_num_threads(1)
    try:
        assert cli.main([*argv, "--eval", str(folder), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
        set_backend_flags(saved)
    final = records(run, "bounce", "eval", "diabetes")[-1]
    scored = json.loads(out.read_text())
    assert scored["step"] == final["step"]
    assert scored["metrics"] == {k: final[k] for k in ("loss", "rmse", "count")}


def test_the_direct_table_read_equals_scikit_learns_unscaled_loader():
    from sklearn.datasets import load_diabetes

    from recipes.diabetes.data import diabetes_table

    features, targets = diabetes_table()
    reference = load_diabetes(return_X_y=True, scaled=False)
    assert np.array_equal(features, reference[0]) and np.array_equal(targets, reference[1])
