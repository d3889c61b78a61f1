"""What each recipe folder must hold besides its code, found by looking at every folder (a new
recipe is checked with nothing to add here): a README.md with the command that runs it, its
own test settings (tiny.yml) that layer over each config as a config file would, and, when it
reads files, example data in its real format. A recipe copied from another builds from its own
package, and the input shape it declares is its data's. recipes/README.md says how to write
them."""

import dataclasses
import re

import pytest

from engine import catalog
from engine.config import description, merge, read_yaml, resolve
from tests.recipes.tiny_settings import TINY, as_overrides, tiny_overrides, tiny_path

RECIPES = catalog.available()
CONFIGS = [(r, v) for r in RECIPES for v in ["", *catalog.variants(r)]]
GUIDE = "see 'Adding a recipe' in recipes/README.md"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_has_a_readme_naming_a_command_to_run_it(recipe):
    readme = catalog.RECIPES_DIR / recipe / "README.md"
    assert readme.is_file(), f"recipes/{recipe}/README.md is missing: {GUIDE}"
    command = rf"(make train RECIPE={recipe}|python -m engine\.train {recipe})(?![\w-])"
    assert re.search(command, readme.read_text()), (
        f"recipes/{recipe}/README.md names no command that runs it "
        f"(make train RECIPE={recipe} ... or python -m engine.train {recipe} ...): {GUIDE}"
    )


@pytest.mark.parametrize(
    "recipe, variant", CONFIGS, ids=[f"{r}-{v or 'config'}" for r, v in CONFIGS]
)
def test_tiny_settings_layer_over_each_config_as_a_config_file_would(recipe, variant):
    assert tiny_path(recipe).is_file(), f"recipes/{recipe}/{TINY} is missing: {GUIDE}"
    assert description(tiny_path(recipe)), f"recipes/{recipe}/{TINY}: no first comment line"
    tiny = read_yaml(tiny_path(recipe))
    found = catalog.load(recipe)
    sections = {"model": found.model_config, "data": found.data_config}
    base = read_yaml(catalog.config_path(recipe))
    chosen = read_yaml(catalog.variant_path(recipe, variant)) if variant else {}
    as_flags = resolve(recipe, base, as_overrides(tiny), sections, variant, chosen)
    as_file = resolve(recipe, base, [], sections, variant, merge(chosen, tiny))
    assert as_flags.to_dict() == as_file.to_dict()


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_that_reads_files_writes_example_data_it_reads(recipe, tmp_path):
    found = catalog.load(recipe)
    reads_files = "root" in {f.name for f in dataclasses.fields(found.data_config)}
    if not reads_files:
        return
    assert found.example_data is not None, (
        f"recipes/{recipe} reads files at data.root but declares no Recipe.example_data: "
        f"the tests could not train it on data of its real format; {GUIDE}"
    )
    cfg, _ = catalog.load_config(recipe, tiny_overrides(recipe, tmp_path))
    assert cfg.data.root == str(tmp_path / recipe)
    train, held_out = found.build_datasets(cfg.data)
    assert len(train) > 0 and len(held_out) > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_builds_from_its_own_folder(recipe):
    """A copied recipe.py still importing the template's builders would train the template."""
    found = catalog.load(recipe)
    for builder in ("build_model", "build_datasets"):
        module = getattr(found, builder).__module__
        assert module.startswith(f"recipes.{recipe}."), (
            f"recipes/{recipe}/recipe.py registers {builder} from {module}: import it from "
            f"recipes.{recipe} (copied from another recipe?)"
        )


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_declared_sample_shape_is_the_training_inputs(recipe, tmp_path):
    """Recipe.sample_shape feeds the FLOPs count (MFU): it must be what the model is given."""
    found = catalog.load(recipe)
    if found.sample_shape is None:
        return
    cfg, _ = catalog.load_config(recipe, tiny_overrides(recipe, tmp_path))
    train, _ = found.build_datasets(cfg.data)
    x, _ = train[0]
    assert tuple(found.sample_shape(cfg.data)) == tuple(x.shape), (
        f"recipes/{recipe}: Recipe.sample_shape gives {tuple(found.sample_shape(cfg.data))}, "
        f"a training input is {tuple(x.shape)}"
    )
