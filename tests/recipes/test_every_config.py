"""Every recipe config and variant (recipes/*/*.yaml) validates, builds its model and data
(tiny, through overrides, from data written in the recipe's real format) and runs two
optimizer steps and an evaluation on CPU, in a real process."""

import json

import pytest
import yaml

from engine.catalog import RECIPES_DIR
from tests.datagen_cifar import write_cifar_batches
from tests.datagen_images import write_image_folder
from tests.helpers import records, run_dir, run_engine

pytestmark = pytest.mark.slow

CONFIGS = sorted(
    (p.parent.name, "" if p.stem == "config" else p.stem) for p in RECIPES_DIR.glob("*/*.yaml")
)
TINY_IMAGES = [
    "model.arch=resnet18",
    "train.batch_size=4",
    "eval.batch_size=8",
    "data.augment.train_size=32",
    "data.augment.ramp_from_size=0",
    "data.augment.eval_resize=36",
    "data.augment.eval_size=32",
    "loader.num_workers=0",
]
TINY = {  # each recipe's overrides for a seconds-long CPU run; a new recipe must add its own
    "digits": lambda data: [],
    "cifar10": lambda data: [
        f"data.root={write_cifar_batches(data / 'cifar10', n_train=40, n_test=20)}",
        "train.batch_size=8",
        "train.compile=false",
        "model.widths=[8, 16, 16]",
        "loader.num_workers=0",
        "sched.warmup_steps=1",
    ],
    "imagenet": lambda data: [f"data.root={write_image_folder(data / 'imagenet')}", *TINY_IMAGES],
    "gpt": lambda data: [
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=2",
        "model.context=16",
        "data.block_size=16",
        "data.eval_fraction=0.01",
        "train.batch_size=4",
        "train.micro_batch_size=null",
        "train.amp=off",
        "train.compile=off",
        "dist.strategy=auto",
        "eval.batch_size=64",
        "sched.warmup_steps=1",
        "loader.num_workers=0",
    ],
}


def test_every_recipe_has_tiny_overrides():
    assert {recipe for recipe, _ in CONFIGS} == set(TINY)


@pytest.mark.parametrize(
    "recipe, variant", CONFIGS, ids=[f"{r}-{v or 'config'}" for r, v in CONFIGS]
)
def test_config_builds_and_takes_two_steps_and_evaluates(recipe, variant, tmp_path):
    overrides = [*TINY[recipe](tmp_path / "data"), "train.max_steps=2", "log.every_steps=1"]
    run_engine(tmp_path, "smoke", *overrides, recipe=recipe, variant=variant, timeout=600)
    steps = [r["step"] for r in records(tmp_path, "smoke", "train", recipe)]
    (evaluation,) = records(tmp_path, "smoke", "eval", recipe)
    assert steps == [1, 2] and evaluation["step"] == 2 and evaluation["count"] > 0
    saved = yaml.safe_load((run_dir(tmp_path, "smoke", recipe) / "config.yaml").read_text())
    assert saved["variant"] == variant
    summary = json.loads((run_dir(tmp_path, "smoke", recipe) / "summary.json").read_text())
    headline = summary["headline"]  # the recipe's task names it: top1, eval_loss
    assert headline in summary and summary[headline] >= 0
