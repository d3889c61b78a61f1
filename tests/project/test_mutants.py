"""`make mutants` stays runnable: each plant's text is still found exactly once in its file,
and each test it names still exists. Code that moves otherwise makes a plant "stale" only
when someone runs the script (it is not part of make test), and the guarantee goes unguarded."""

import re

import pytest

from tests.mutants import PLANTS, REPO


@pytest.mark.parametrize("plant", PLANTS, ids=[p.name for p in PLANTS])
def test_each_plant_applies_and_names_tests_that_exist(plant):
    code = (REPO / plant.file).read_text()
    assert code.count(plant.old) == 1, f"{plant.file} no longer holds the plant's text once"
    assert plant.new != plant.old and plant.tests
    for node in plant.tests:  # a module, or a test function in it (a parameter in [...])
        path, _, name = node.partition("::")
        text = (REPO / path).read_text()
        function = re.sub(r"\[.*\]$", "", name)
        assert not function or re.search(rf"^def {function}\(", text, re.M), node
