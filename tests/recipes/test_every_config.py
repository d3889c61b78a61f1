"""Every recipe config and variant (recipes/*/*.yaml) validates, builds its model and data
(tiny, through the recipe's own recipes/<name>/tiny.yml, from its example data written in the
recipe's real format) and runs two optimizer steps and an evaluation on CPU, in the test's
process (the subject is the config, not a process's start-up: tests/recipes/test_digits.py and
the distributed tests start real ones). A new recipe folder is found and run with nothing to
add here."""

import json

import pytest
import yaml

from engine.catalog import available, load_config, variants
from tests.helpers import cache_stand_in_weights, records, run_dir
from tests.recipes.tiny_settings import tiny_overrides

pytestmark = pytest.mark.slow

CONFIGS = [(r, v) for r in available() for v in ["", *variants(r)]]


@pytest.mark.parametrize(
    "recipe, variant", CONFIGS, ids=[f"{r}-{v or 'config'}" for r, v in CONFIGS]
)
def test_config_builds_and_takes_two_steps_and_evaluates(
    recipe, variant, tmp_path, train_here, monkeypatch
):
    overrides = [
        *tiny_overrides(recipe, tmp_path / "data"),
        "train.max_steps=2",
        "log.every_steps=1",
    ]
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cfg, _ = load_config(recipe, overrides, variant)
    if cfg.model.weights:  # a fine-tune variant: a stand-in file for its named weights
        cache_stand_in_weights(cfg.model.weights, cfg.model.arch, tmp_path / "torch")
    train_here(tmp_path, "smoke", *overrides, recipe=recipe, variant=variant)
    steps = [r["step"] for r in records(tmp_path, "smoke", "train", recipe)]
    (evaluation,) = records(tmp_path, "smoke", "eval", recipe)
    assert steps == [1, 2] and evaluation["step"] == 2 and evaluation["count"] > 0
    saved = yaml.safe_load((run_dir(tmp_path, "smoke", recipe) / "config.yaml").read_text())
    assert saved["variant"] == variant
    summary = json.loads((run_dir(tmp_path, "smoke", recipe) / "summary.json").read_text())
    headline = summary["headline"]  # the recipe's task names it: top1, eval_loss
    assert headline in summary and summary[headline] >= 0
