"""Property-based tests of config resolution. Whatever the overrides or the YAML, the answer
is a Config or a one-line ConfigError, never another exception; a number inside a field's
declared range is accepted and one outside is refused, naming the key. And the real CLI turns
a bad value into exit 2 and one `error:` line, before it writes anything."""

import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine import catalog as R
from engine import config as C
from tests.engine.test_config import leaf_fields
from tests.helpers import REPO, engine_env

DIGITS = R.load("digits")
DIGITS_SECTIONS = {"model": DIGITS.model_config, "data": DIGITS.data_config}
FUZZ = settings(max_examples=150, deadline=None, database=None)  # a few seconds each

REAL_KEYS = [
    key
    for name, cls in (C.ENGINE_SECTIONS | DIGITS_SECTIONS).items()
    for key, _, _ in leaf_fields(name, cls)
] + list(C.TOP_LEVEL)
TRICKY_TEXT = [  # YAML that reads as something else, is invalid, or makes PyYAML raise
    *["0123", "1e3", "0x1F", "true", "off", "null", "~", ".nan", "-.inf", "2001-13-45"],
    *["[1, 2]", "{a: 1}", "[", "{", "'", '"', "!!python/object:os.system", "&a [*a]"],
    *["!!int abc", "!!binary x", "9" * 5000, "a\nb", "\u2028", "=", ".."],
]
DEEP = "[" * 1100 + "]" * 1100  # libyaml refuses more than 1,000 levels; PyYAML recurses


def yaml_values(keys: st.SearchStrategy) -> st.SearchStrategy:
    """Nested dicts, lists and scalars of every type YAML produces."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.text(max_size=12),
        st.sampled_from(TRICKY_TEXT),
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
        max_leaves=12,
    )


# Characters that str.splitlines() breaks at: a message must stay one line even with them.
LINE_BREAKS = st.sampled_from(["\n", "\r", "\x0b", "\x85", "\u2028", "a\nb"])
WORDS = st.text(max_size=8) | LINE_BREAKS  # any unicode, empty, '=' and '.' included


def dotted_keys() -> st.SearchStrategy:
    words = WORDS
    made_up = st.lists(words, min_size=1, max_size=4).map(".".join)
    under_a_real_section = st.tuples(st.sampled_from(REAL_KEYS), words).map(
        lambda pair: f"{pair[0].rsplit('.', 1)[0]}.{pair[1]}"
    )
    return st.one_of(st.sampled_from(REAL_KEYS), under_a_real_section, made_up)


def override_values() -> st.SearchStrategy:
    return st.one_of(
        st.text(max_size=16),
        st.sampled_from(TRICKY_TEXT),
        st.integers().map(str),
        st.floats().map(repr),
        yaml_values(st.text(max_size=6)).map(
            lambda v: yaml.safe_dump(v, default_flow_style=True, width=10**6).strip()
        ),
    )


OVERRIDES = st.lists(
    st.one_of(
        st.tuples(dotted_keys(), override_values()).map("=".join),
        st.text(max_size=24),  # anything at all, with or without '='
    ),
    max_size=5,
)
SECTION_NAMES = st.sampled_from([*C.ENGINE_SECTIONS, *DIGITS_SECTIONS, *C.TOP_LEVEL, "variant"])
FIELD_NAMES = st.sampled_from([key.rsplit(".", 1)[-1] for key in REAL_KEYS])
CONFIG_SHAPED = st.dictionaries(
    SECTION_NAMES | WORDS,
    yaml_values(FIELD_NAMES | WORDS | st.integers()),
    max_size=5,
)


def resolves_or_one_config_error(recipe_yaml=None, overrides=(), sections=DIGITS_SECTIONS):
    try:
        cfg = C.resolve("digits", recipe_yaml or {}, list(overrides), sections)
    except C.ConfigError as err:
        assert len(str(err).splitlines()) == 1, repr(str(err))
        return err
    assert isinstance(cfg, C.Config)
    return cfg


@FUZZ
@given(OVERRIDES)
@example(["train.epochs=" + "9" * 5000])  # more digits than int() converts
def test_any_overrides_give_a_config_or_one_config_error(overrides):
    resolves_or_one_config_error(overrides=overrides)


@FUZZ
@given(CONFIG_SHAPED, OVERRIDES)
def test_any_yaml_config_gives_a_config_or_one_config_error(recipe_yaml, overrides):
    resolves_or_one_config_error(recipe_yaml, overrides)


YAML_FILES = st.one_of(
    CONFIG_SHAPED.map(lambda doc: yaml.safe_dump(doc, allow_unicode=True).encode()),
    st.text().map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.lists(st.sampled_from(TRICKY_TEXT + ["run:", "  name: 1", "- x", ":"])).map(
        lambda lines: "\n".join(lines).encode()
    ),
    st.binary(max_size=64),  # also bytes that are not UTF-8
)


@FUZZ
@given(YAML_FILES)
def test_any_yaml_file_reads_as_a_mapping_or_one_config_error(content):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_bytes(content)
        try:
            data = C.read_yaml(path)
        except C.ConfigError as err:
            assert len(str(err).splitlines()) == 1, repr(str(err))
            return
    assert isinstance(data, dict)
    resolves_or_one_config_error(data)


def test_yaml_nested_too_deep_for_the_parser_is_one_config_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text(f"train: {{milestones: {DEEP}}}")
    with pytest.raises(C.ConfigError, match="deep.yaml: not valid YAML"):
        C.read_yaml(path)
    error = resolves_or_one_config_error(overrides=[f"sched.milestones={DEEP}"])
    assert str(error).startswith("sched.milestones: expected a list, got '[[[")


# ------------------------------------------------ declared ranges, exactly what resolve takes

BASE = ["train.max_steps=1"]  # so that train.epochs=0 is in range and also valid across fields


def ranged_fields() -> list[tuple[str, str, type, C.Range, object]]:
    """(recipe, dotted key, annotation, range, default) of every bounded field."""
    found = [
        ("digits", key, t, C.TOP_RANGES[key], 0)
        for key, t in C.TOP_TYPES.items()
        if key in C.TOP_RANGES
    ]
    for recipe in R.available():
        loaded = R.load(recipe)
        sections = C.ENGINE_SECTIONS if recipe == "digits" else {}
        sections = sections | {"model": loaded.model_config, "data": loaded.data_config}
        for name, cls in sections.items():
            for key, annotation, f in leaf_fields(name, cls):
                if "range" in f.metadata:
                    found.append((recipe, key, annotation, f.metadata["range"], f))
    return found


RANGED = ranged_fields()


def number_kind(annotation) -> type:
    text = str(annotation)
    return float if "float" in text else int


def inside(kind: type, allowed: C.Range) -> st.SearchStrategy:
    low = allowed.ge if allowed.ge is not None else allowed.gt
    high = allowed.le if allowed.le is not None else allowed.lt
    if kind is int:
        low = None if low is None else math.floor(low) + (allowed.gt is not None)
        high = None if high is None else math.ceil(high) - (allowed.lt is not None)
        return st.integers(min_value=low, max_value=high)
    return st.floats(
        min_value=low,
        max_value=high,
        exclude_min=allowed.gt is not None,
        exclude_max=allowed.lt is not None,
        allow_nan=False,
        allow_infinity=False,
    )


def outside(kind: type, allowed: C.Range) -> st.SearchStrategy:
    sides = []
    low = allowed.ge if allowed.ge is not None else allowed.gt
    high = allowed.le if allowed.le is not None else allowed.lt
    if kind is int:
        if low is not None:
            sides.append(st.integers(max_value=math.ceil(low) - (allowed.ge is not None)))
        if high is not None:
            sides.append(st.integers(min_value=math.floor(high) + (allowed.le is not None)))
        return st.one_of(sides)
    if low is not None:
        sides.append(st.floats(max_value=low, exclude_max=allowed.ge is not None))
    if high is not None:
        sides.append(st.floats(min_value=high, exclude_min=allowed.le is not None))
    return st.one_of(*sides, st.sampled_from([math.nan, math.inf, -math.inf]))


def as_text(value, is_list: bool) -> str:
    if isinstance(value, int):
        return str(value)
    # In a YAML list a float needs its dot ("1.0e-05"); a scalar float field also takes repr's
    # "1e-05", which exercises the exponent form.
    return f"{value:.17e}" if is_list and math.isfinite(value) else repr(value)


def override_for(key: str, annotation, values: list) -> str:
    if "list" in str(annotation):
        return f"{key}=[{', '.join(as_text(v, True) for v in values)}]"
    return f"{key}={as_text(values[0], False)}"


def resolve_with(recipe: str, override: str) -> C.Config:
    loaded = R.load(recipe)
    sections = {"model": loaded.model_config, "data": loaded.data_config}
    return C.resolve(recipe, {}, [*BASE, override], sections)


@settings(max_examples=400, deadline=None, database=None)
@given(st.sampled_from(RANGED), st.data())
def test_a_number_inside_its_declared_range_is_accepted_and_outside_refused(field, data):
    recipe, key, annotation, allowed, _ = field
    kind = number_kind(annotation)
    count = 2 if key == "optim.betas" else 1  # optim.betas takes exactly two
    good = data.draw(st.lists(inside(kind, allowed), min_size=count, max_size=count))
    cfg = resolve_with(recipe, override_for(key, annotation, good))
    got = cfg.sections.get(key.split(".")[0]) if "." in key else getattr(cfg, key)
    for part in key.split(".")[1:]:
        got = getattr(got, part)
    assert got == (good if "list" in str(annotation) else good[0])

    bad = data.draw(outside(kind, allowed))
    with pytest.raises(C.ConfigError) as err:
        resolve_with(recipe, override_for(key, annotation, [bad] * count))
    assert str(err.value).startswith(key), str(err.value)


# ------------------------------------------------------------------ the real command line

BAD_VALUES = [  # a few only: each process spends seconds importing torch
    ("eval.batch_size=0", "eval.batch_size must be >= 1, got 0"),
    ("train.grad_clip=-1", "train.grad_clip must be >= 0, got -1.0"),
    ("model.dropout=1.5", "model.dropout must be in [0, 1), got 1.5"),
]


@pytest.mark.slow
def test_bad_values_on_the_command_line_exit_2_with_one_error_line_and_no_run_dir(tmp_path):
    started = []
    for i, (override, _) in enumerate(BAD_VALUES):  # in parallel: each start imports torch
        root = tmp_path / str(i)
        root.mkdir()
        cmd = [sys.executable, "-m", "engine.train", "digits", override, "device=cpu"]
        cmd += ["log.wandb=off", f"run.root={root}"]
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=engine_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        started.append((proc, root))
    for (proc, root), (override, message) in zip(started, BAD_VALUES, strict=True):
        _, stderr = proc.communicate(timeout=120)
        lines = stderr.decode().splitlines()
        assert proc.returncode == 2, (override, stderr)
        assert lines == [f"error: {message}"], (override, stderr)
        assert list(root.iterdir()) == [], override  # no run directory
