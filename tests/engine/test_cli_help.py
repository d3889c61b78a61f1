"""`python -m engine.train --help` lists every config key with its type, default, range and
meaning, generated from the config dataclasses: a key added to engine/config/sections.py appears
without anyone editing a help text, and a key added without a comment fails here."""

import dataclasses
import re
import subprocess
import sys
import typing
from dataclasses import dataclass
from typing import Literal

import pytest

from engine import catalog
from engine import config as C
from engine.cli import help_text
from tests.helpers import REPO, engine_env, engine_here


def engine_fields(everything: bool = True):
    for name, cls in C.ENGINE_SECTIONS.items():
        if everything or not C.is_test_only(cls):
            for f in dataclasses.fields(cls):
                yield f"{name}.{f.name}", cls, f


def test_every_engine_key_has_a_meaning():
    missing = [key for key, cls, f in engine_fields() if not C.field_meanings(cls).get(f.name)]
    top = C.field_meanings(C.Config)
    missing += [key for key in C.TOP_LEVEL if not top.get(key)]
    assert missing == [], f"add a comment beside or above each of these fields: {missing}"


@dataclass
class Planted:
    """A section as a test plants it."""

    beside: int = C.bounded(1, ge=0)  # the comment on the line
    # the comment lines above,
    # joined into one
    above: str = "x"
    # a comment above is not used when the line has its own
    both: bool = False  # the line's own

    bare: float = 0.5


def test_meanings_come_from_the_comment_beside_else_the_lines_above():
    assert C.field_meanings(Planted) == {
        "beside": "the comment on the line",
        "above": "the comment lines above, joined into one",
        "both": "the line's own",
        "bare": "",  # what test_every_engine_key_has_a_meaning refuses
    }
    assert C.class_summary(Planted) == "A section as a test plants it."
    assert C.class_summary(C.RunConfig) == ""  # not dataclass's generated signature


def help_line(text: str, key: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith(f"  {key} ")]
    return line


def test_help_lists_every_engine_key_with_type_default_range_and_meaning():
    text = help_text("")
    for key, cls, f in engine_fields(everything=False):
        line = help_line(text, key)
        annotation = typing.get_type_hints(cls)[f.name]
        default = f.default_factory() if callable(f.default_factory) else f.default
        assert f" {C.type_name(annotation)} = {C.show_value(default)} " in line + " ", line
        if f.metadata.get("range"):
            assert f"({f.metadata['range']})" in line, line
        assert line.endswith(C.field_meanings(cls)[f.name]), line
    for key in C.TOP_LEVEL:
        assert C.field_meanings(C.Config)[key] in help_line(text, key)


def test_help_leaves_out_test_only_sections_and_help_all_lists_them():
    text, everything = help_text(""), help_text("", everything=True)
    assert "fault.raise_at_step" not in text and "not listed: fault" in text
    help_line(everything, "fault.raise_at_step")


def test_a_recipes_help_shows_the_recipes_values_not_the_engines_defaults():
    # digits' config.yaml trains 15 epochs; the engine's default is 1.
    assert re.search(r"int = 1 ", help_line(help_text(""), "train.epochs"))
    digits = help_text("digits")
    assert re.search(r"int = 15 ", help_line(digits, "train.epochs"))
    cfg = catalog.load_config("digits", [])[0]
    assert f"= {C.show_value(cfg.optim.lr)} " in help_line(digits, "optim.lr")


def test_help_lines_read_as_key_type_default_range_meaning():
    text = help_text("")
    assert re.fullmatch(
        r"  optim\.lr +float = 0\.1 +\(> 0\) +peak learning rate \(after warmup\)",
        help_line(text, "optim.lr"),
    )
    assert re.match(r"  train\.amp +auto\|off\|bf16\|fp16 = auto ", help_line(text, "train.amp"))
    assert re.match(r"  log\.entity +str \| null = null ", help_line(text, "log.entity"))
    assert re.match(r"  seed +int = 0 +\(in \[0, 2\*\*64\)\) ", help_line(text, "seed"))
    assert "sched: Counted in optimizer steps;" in text  # a section's docstring heads it


def test_a_recipes_help_adds_its_model_and_data_sections_and_variants():
    assert "model.width" not in help_text("")
    text = help_text("digits")
    recipe = catalog.load("digits")
    for name, cls in (("model", recipe.model_config), ("data", recipe.data_config)):
        for f in dataclasses.fields(cls):
            help_line(text, f"{name}.{f.name}")
    assert "0: follows the training data" in help_line(text, "model.num_classes")
    nested = help_text("imagenet")  # a nested section's keys, by their dotted path
    assert "RandomResizedCrop" in help_line(nested, "data.augment.scale_min")
    assert re.search(r"^  --config v2 +\S", nested, re.MULTILINE)


@pytest.mark.parametrize(
    ("args", "recipe"),
    [(["--help"], ""), (["-h"], ""), (["digits", "--help", "optim.lr=1"], "digits")],
)
def test_help_exits_0_printing_usage_then_the_keys(tmp_path, args, recipe):
    out = engine_here(*args, cwd=tmp_path)  # the real process: the unknown recipe's test
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m engine.train RECIPE")
    assert out.stdout == help_text(recipe) + "\n"
    assert list(tmp_path.iterdir()) == []


def test_help_for_an_unknown_recipe_is_the_usual_one_line_error(tmp_path):
    cmd = [sys.executable, "-m", "engine.train", "nosuch", "--help"]
    out = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env=engine_env(), timeout=120
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: unknown recipe 'nosuch'") and out.stderr.count("\n") == 1


def test_type_names_show_a_literals_choices_and_yaml_null():
    assert C.type_name(Literal["a", "b"]) == "a|b"
    assert C.type_name(int | None) == "int | null"
    assert C.type_name(list[float]) == "list[float]"
    assert [C.show_value(v) for v in (None, True, "", [0.9, 0.999], "env://")] == [
        "null",
        "true",
        "''",
        "[0.9, 0.999]",
        "env://",
    ]
