"""Fields and values: what a key may hold and how a value is read and checked.

Each numeric field declares its valid range beside its default (`bounded`), checked for
engine and recipe sections alike. A field may also declare whether a resumed run may change it
(`resume_safe`, beside the default as well: `bounded(..., resume_safe=True)`, `safe(default)`,
`guarded(default)`).

An override's value is read by its field's type: a text field (str, str | None, a Literal of
strings) takes the text as written, so `run.name=0123` is "0123"; for `str | None` YAML's
spellings of null (empty, ~, null, Null, NULL) mean None, as in a config file. Other fields
read the value as YAML (`optim.lr=0.2`, `train.amp=off`, `sched.milestones=[1, 2]`), a float
field also in exponent form (`optim.lr=1e-3`). In YAML files values stay YAML: a number where
text is expected (`name: 0123`) is an error, never a silent "83"."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A user mistake in the configuration; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class Range:
    """The valid values of a number: each bound inclusive (ge, le) or not (gt, lt), or open."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def admits(self, value: float) -> bool:
        # Every comparison with NaN is false, so NaN is outside any range with a bound.
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def __str__(self) -> str:
        ge, gt, le, lt = (_show(bound) for bound in (self.ge, self.gt, self.le, self.lt))
        if (ge is not None or gt is not None) and (le is not None or lt is not None):
            opening = f"[{ge}" if ge is not None else f"({gt}"
            closing = f"{le}]" if le is not None else f"{lt})"
            return f"in {opening}, {closing}"  # e.g. in [0, 1)
        bounds = [(">=", ge), (">", gt), ("<=", le), ("<", lt)]
        return " and ".join(f"{op} {bound}" for op, bound in bounds if bound is not None)


def _show(bound: float | None) -> str | None:
    """A bound as written in a message: 2**64 rather than its twenty digits."""
    if isinstance(bound, int) and bound >= 2**16 and bound.bit_count() == 1:
        return f"2**{bound.bit_length() - 1}"
    return None if bound is None else str(bound)


# The field metadata key, and the section class attribute, that declare whether a resumed run
# may change a key and stay the same run: how it is logged, evaluated, checkpointed, loaded and
# spread over processes, and how long it goes on, but not what it trains (seed, batch,
# optimizer, schedule, model, data, augmentation). A field's declaration overrides its
# section's; a key declared nowhere is not safe.
RESUME_SAFE = "resume_safe"


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    resume_safe: bool | None = None,
) -> Any:
    """A dataclass field with a valid range; it applies to each item of a list, and None
    (for an optional field) always passes. Example: `batch_size: int = bounded(64, ge=1)`.
    resume_safe: whether a resumed run may change it (None: as its section declares)."""
    metadata: dict[str, Any] = {"range": Range(ge=ge, gt=gt, le=le, lt=lt)}
    if resume_safe is not None:
        metadata[RESUME_SAFE] = resume_safe
    return field(default=default, default_factory=default_factory, metadata=metadata)


def safe(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field (without a range) that a resumed run may change: `tf32: bool = safe(True)`."""
    return field(default=default, default_factory=default_factory, metadata={RESUME_SAFE: True})


def guarded(
    default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING
) -> Any:
    """A field (without a range) that a resumed run may not change, in a section that is safe
    to change as a whole (`resume_safe = True` on the class)."""
    return field(default=default, default_factory=default_factory, metadata={RESUME_SAFE: False})


def is_resume_safe(cls: type, f: dataclasses.Field) -> bool:
    """Whether a resumed run may change this field of section `cls`: the field's own
    declaration, else its section's (a class attribute `resume_safe`), else not."""
    return bool(f.metadata.get(RESUME_SAFE, getattr(cls, RESUME_SAFE, False)))


YAML_NULLS = ("", "~", "null", "Null", "NULL")  # YAML's spellings of null, as in a file
# PyYAML raises more than YAMLError: ValueError for the date 2001-13-45 or an int too long to
# convert, RecursionError for deeply nested brackets.
YAML_FAILURES = (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError)
# libyaml's parser where PyYAML was built with it (its wheels are), Python's otherwise: the
# same safe constructor and resolver, so the same values, read ~10 times faster (a process
# reads the base, recipe and variant files at each resolution). libyaml also refuses nesting
# deeper than 1,000 levels with a YAMLError instead of recursing.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # and its emitter: the same text


def load_yaml(text: str | bytes) -> Any:
    """yaml.safe_load, through libyaml when it is there. Text holding surrogates (bytes of an
    argument that were not UTF-8) goes to Python's parser, which names them; libyaml cannot
    encode them."""
    try:
        return yaml.load(text, Loader=SAFE_LOADER)  # noqa: S506 (a safe loader)
    except UnicodeEncodeError:
        return yaml.safe_load(text)


def dump_yaml(data: Any) -> str:
    """yaml.safe_dump(data, sort_keys=False), through libyaml's emitter when it is there; with
    surrogates in a value, Python's emitter, which escapes them."""
    try:
        return yaml.dump(data, Dumper=SAFE_DUMPER, sort_keys=False)
    except UnicodeEncodeError:
        return yaml.safe_dump(data, sort_keys=False)


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints of a section class, evaluated once (each evaluation compiles
    every string annotation again); read-only."""
    return typing.get_type_hints(cls)


def _closest(key: str, options: typing.Iterable[str], prefix: str = "") -> str:
    options = list(options)
    match = difflib.get_close_matches(str(key), options, n=1, cutoff=0.5)  # YAML keys: any type
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return f"; valid keys: {', '.join(prefix + o for o in options)}"


def _check_type(path: str, value: Any, annotation: Any) -> Any:
    """Return value converted to `annotation`, or raise ConfigError naming `path`."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        value = _on_off(value, choices)
        if value not in choices or isinstance(value, bool) and True not in choices:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check_type(path, value, inner)
    if dataclasses.is_dataclass(annotation):  # a nested section, e.g. data.augment
        return build_section(path, annotation, value)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_check_type(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int | float) and not isinstance(value, bool):
        return _finite_float(path, value)
    if annotation is str and isinstance(value, int | float | datetime.date):
        # A YAML file's `name: 0123` is the int 83: refuse it rather than run as "83".
        raise ConfigError(
            f"{path}: expected str, got {value!r}; YAML read a number, boolean or date, "
            "so quote the value to keep it as written"
        )
    if annotation in (int, float) and isinstance(value, bool) or not isinstance(value, annotation):
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{path}: expected {name}, got {value!r}")
    return value


ON_OFF = {True: "on", False: "off", "true": "on", "false": "off"}


def _on_off(value: Any, choices: tuple) -> Any:
    """YAML 1.1 reads a bare `on`/`off` (and true/false) as booleans: for a field whose
    choices are on/off, they mean on/off (so `train.compile=true` keeps working)."""
    if isinstance(value, bool | str) and value in ON_OFF and ON_OFF[value] in choices:
        return ON_OFF[value]
    return value


def build_section(name: str, cls: type, values: dict[str, Any]) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {values!r}")
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        path = f"{name}.{key}"
        if key not in fields:  # !r: a key with a line break still prints as one line
            raise ConfigError(f"unknown config key {path!r}{_closest(key, fields, name + '.')}")
        kwargs[key] = _check_type(path, value, hints[key])
        _check_range(path, kwargs[key], fields[key].metadata.get("range"))
    return cls(**kwargs)


def _finite_float(path: str, value: int | float) -> float:
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{path} must be a finite number, got {value!r}")
    return number


def _check_range(path: str, value: Any, allowed: Range | None) -> None:
    """Raise ConfigError unless value (each item of a list; None passes) is in range."""
    if allowed is None or value is None:
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_range(f"{path}[{i}]", item, allowed)
    elif not allowed.admits(value):
        raise ConfigError(f"{path} must be {allowed}, got {value!r}")


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def parse_overrides(
    overrides: typing.Sequence[str], schema: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Dotted key=value overrides as a tree of values. `schema` maps top-level keys to their
    types (sections to dataclasses), so that each value is read by its field's type."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r} is not key=value (example: optim.lr=0.2)")
        _set_dotted(tree, key, _parse_value(raw, _declared_type(schema or {}, key)))
    return tree


def _declared_type(schema: dict[str, Any], dotted: str) -> Any:
    """The annotation of a dotted key, through nested sections; None for an unknown key."""
    node: Any = schema
    for part in dotted.split("."):
        if isinstance(node, type) and dataclasses.is_dataclass(node):
            node = type_hints(node)
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


DECIMAL = re.compile(r"[+-]?[0-9]+")


def _parse_value(raw: str, annotation: Any) -> Any:
    """An override's text as a value for `annotation` (None: a key no section declares)."""
    if _is_text(annotation):
        return None if raw in YAML_NULLS and type(None) in _union_args(annotation) else raw
    if not raw:
        return ""
    if annotation == list[str]:
        return _text_list(raw)
    if int in _union_args(annotation) and DECIMAL.fullmatch(raw):
        try:
            return int(raw, 10)  # YAML 1.1 reads 010 as octal 8
        except ValueError:  # more digits than Python converts: left as text, named as such
            return raw
    try:
        value = load_yaml(raw)
    except YAML_FAILURES:
        return raw  # left as text; the type check names the key
    if isinstance(value, str) and float in _union_args(annotation):
        try:
            return float(raw)  # YAML 1.1 reads 1e-3 (no dot) as text
        except ValueError:
            pass
    return value


def _text_list(raw: str) -> Any:
    """A list of text as written: `[fc.*=1, *=0.1]` is two patterns, although YAML reads a
    leading `*` as an alias (and a shell has already taken the quotes that would hide it)."""
    try:
        value = load_yaml(raw)
    except YAML_FAILURES:
        value = None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    if raw.startswith("[") and raw.endswith("]"):
        items = (item.strip().strip("'\"") for item in raw[1:-1].split(","))
        return [item for item in items if item]
    return value if value is not None else raw


def _union_args(annotation: Any) -> tuple:
    """The members of a union (`str | None`: str and NoneType), or the annotation alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_text(annotation: Any) -> bool:
    """str, str | None or a Literal of strings: an override's text is the value as written."""

    def text(member: Any) -> bool:
        if typing.get_origin(member) is Literal:
            return all(isinstance(choice, str) for choice in typing.get_args(member))
        return member is str

    members = [m for m in _union_args(annotation) if m is not type(None)]
    return bool(members) and all(text(m) for m in members)
