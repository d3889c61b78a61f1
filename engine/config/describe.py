"""The keys, described: what `python -m engine.train --help` lists for every key (its type,
default, range and meaning), generated from the section dataclasses. A field's meaning is the
comment at the end of its line, else the comment lines just above it."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import math
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from engine.config.fields import type_hints
from engine.config.sections import TOP_LEVEL, TOP_RANGES, TOP_TYPES, Config


@dataclass(frozen=True)
class KeyHelp:
    """One key as --help lists it."""

    key: str  # dotted, e.g. optim.lr
    kind: str  # its type: float, str | null, list[int], or a Literal's choices (on|off)
    default: str  # as YAML writes it
    range: str  # the valid range (Range.__str__), "" for none
    meaning: str  # from the comments beside the field (field_meanings)


def describe_section(prefix: str, cls: type, values: Any = None) -> list[KeyHelp]:
    """The keys of a section (a nested section's as prefix.name.key), in declaration order;
    `values`: a resolved section whose values are shown instead of the field defaults (a
    recipe's own, e.g. digits' train.epochs=15)."""
    hints = type_hints(cls)
    meanings = field_meanings(cls)
    rows = []
    for f in dataclasses.fields(cls):
        key, annotation = f"{prefix}.{f.name}", hints[f.name]
        if dataclasses.is_dataclass(annotation):
            rows += describe_section(key, annotation, getattr(values, f.name, None))
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default
        default = getattr(values, f.name) if values is not None else default
        allowed = f.metadata.get("range")
        meaning = meanings.get(f.name, "")
        rows.append(
            KeyHelp(key, type_name(annotation), show_value(default), str(allowed or ""), meaning)
        )
    return rows


def describe_top_level(values: Any = None) -> list[KeyHelp]:
    """The top-level keys; their meanings are those of Config's fields (values: a resolved
    Config whose values are shown instead of the defaults)."""
    meanings = field_meanings(Config)
    return [
        KeyHelp(
            key,
            type_name(TOP_TYPES[key]),
            show_value(getattr(values, key) if values is not None else default),
            str(TOP_RANGES.get(key) or ""),
            meanings.get(key, ""),
        )
        for key, default in TOP_LEVEL.items()
    ]


def type_name(annotation: Any) -> str:
    """A type as --help shows it: a Literal as its choices, None as YAML's null."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "|".join(map(str, typing.get_args(annotation)))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(member) for member in typing.get_args(annotation))
    if origin is list:
        return f"list[{type_name(typing.get_args(annotation)[0])}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def show_value(value: Any) -> str:
    """A value as YAML writes it in one line: null, true, '', [0.9, 0.999]."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
    return text.removesuffix("\n").removesuffix("\n...")


def class_summary(cls: type) -> str:
    """The first paragraph of the class's own docstring, in one line ("" for none: a
    dataclass without one gets a generated signature, which is not a summary)."""
    source = _class_source(cls)
    docstring = ast.get_docstring(ast.parse(source).body[0]) if source else None
    return " ".join((docstring or "").split("\n\n")[0].split())


def field_meanings(cls: type) -> dict[str, str]:
    """Each field's meaning, read from the comments in the class's source: the comment at the
    end of the field's line, else the comment lines just above it, joined into one line.
    "" for a field without one; {} when the source cannot be read."""
    found: dict[str, str] = {}
    for owner in [*reversed(cls.__mro__), getattr(cls, "meanings_from", object)]:
        if dataclasses.is_dataclass(owner) and "__dataclass_fields__" in vars(owner):
            found |= _own_meanings(owner)
    return found


def _own_meanings(cls: type) -> dict[str, str]:
    """The meanings of the fields declared in cls's own source."""
    source = _class_source(cls)
    if not source:
        return {}
    comments = _comments_by_line(source)
    body = ast.parse(source).body[0].body
    return {
        node.target.id: _meaning(node, comments)
        for node in body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


@functools.cache  # inspect parses the class's whole module to find it: once per class
def _class_source(cls: type) -> str:
    try:
        return textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return ""


def _comments_by_line(source: str) -> dict[int, tuple[bool, str]]:
    """line number -> (whether the comment fills its line, its text without the '#')."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            fills_line = not token.line[: token.start[1]].strip()
            found[token.start[0]] = (fills_line, token.string.lstrip("#").strip())
    return found


def _meaning(node: ast.AnnAssign, comments: dict[int, tuple[bool, str]]) -> str:
    for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
        fills_line, text = comments.get(number, (True, ""))
        if not fills_line:
            return text
    above: list[str] = []
    number = node.lineno - 1
    while comments.get(number, (False, ""))[0]:
        above.insert(0, comments[number][1])
        number -= 1
    return " ".join(above)
