"""What the engine needs from a recipe comes from the recipe or its task: a declared Task
interface every recipe's task satisfies, top-k only below the class count, and the mirror
view for eval.hflip_tta only where the recipe declares one."""

from pathlib import Path

import pytest
import torch

from engine import catalog
from engine.tasks import Classification, NextToken, Task, task_of
from tests.helpers import QUIET, engine_here, run_dir
from tests.recipes.tiny_settings import tiny_overrides


@pytest.mark.parametrize("name", catalog.available())
def test_every_recipes_task_satisfies_the_interface(name, tmp_path):
    cfg, recipe = catalog.load_config(name, [])
    task = task_of(recipe).for_model(cfg.model)
    assert isinstance(task, Task)
    assert isinstance(task.higher_is_better, bool) and task.unit
    assert task.metrics[0] == "loss" and "count" not in task.metrics
    output, target = three_samples(name, task, tmp_path)
    sums = task.eval_sums(output, target)
    assert set(sums) == {*task.metrics, "count"} and all(v.shape == (3,) for v in sums.values())
    means = {m: float(sums[m].sum() / sums["count"].sum()) for m in task.metrics}
    assert task.headline in {*means, *task.derived(means)}


def three_samples(name: str, task, data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """An output and a target of three samples as the task is given them: the engine's tasks'
    shapes, and for a task of a recipe's own (recipes/README.md, "A task of your own") its
    model's output on three of its training items (its tiny settings and example data)."""
    if isinstance(task, Classification):
        return torch.randn(3, 7), torch.randint(0, 7, (3,))
    if isinstance(task, NextToken):
        return torch.randn(3, 4, 7), torch.randint(0, 7, (3, 4))
    cfg, recipe = catalog.load_config(name, tiny_overrides(name, data))
    train, _ = recipe.build_datasets(cfg.data)
    inputs, targets = zip(*(train[i] for i in range(3)), strict=True)
    with torch.no_grad():
        return recipe.build_model(cfg.model)(torch.stack(inputs)), torch.stack(targets)


def test_the_interface_check_refuses_a_task_without_its_direction():
    class NoDirection(NextToken):
        pass

    assert isinstance(NoDirection(), Task)
    del NextToken.higher_is_better
    try:
        assert not isinstance(NoDirection(), Task)
    finally:
        NextToken.higher_is_better = False


@pytest.mark.parametrize("classes, top5", [(3, False), (5, False), (6, True), (10, True)])
def test_top5_only_where_there_are_more_than_five_classes(classes, top5):
    task = Classification().for_model(type("M", (), {"num_classes": classes})())
    sums = task.eval_sums(torch.randn(4, classes), torch.randint(0, classes, (4,)))
    assert ("top5" in task.metrics) == top5 and ("top5" in sums) == top5
    assert ("top5" in task.describe(dict.fromkeys(task.metrics, 0.5))) == top5


def test_hflip_tta_is_refused_for_a_recipe_without_a_mirror_view(tmp_path):
    run = [f"run.root={tmp_path}", "run.name=tta", "train.max_steps=1", "eval.hflip_tta=true"]
    out = engine_here("digits", *QUIET, *run)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "eval.hflip_tta" in line and "Recipe.mirror" in line and "Traceback" not in out.stderr
    assert not run_dir(tmp_path, "tta").exists()
