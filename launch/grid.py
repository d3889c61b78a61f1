"""A sweep's grid: the settings it varies, their values, the baseline cell and what every
member shares; from the command line or from a sweep file. Pure: nothing here runs.

On the command line a value list is written with commas, split only outside brackets and
quotes: `make sweep ARGS="optim.lr=0.05,0.1,0.2 mix.mixup_alpha=0,0.2"` sweeps 3 x 2 cells,
`optim.betas=[0.9,0.99]` stays one value. A sweep file (`SWEEP=file.yaml`) also takes
parameters varied together (`zip`), a named baseline and the sweep's name:

    name: lr-mix            # the sweep's run.name (ARGS' run.name must agree)
    seeds: 3                # SEEDS, when SEEDS is not given
    parallel: 4             # SLURM: at most this many array tasks at once (PARALLEL)
    grid:                   # every combination
      optim.lr: [0.05, 0.1, 0.2]
      mix.mixup_alpha: [0, 0.2]
    zip:                    # varied together: the i-th value of each key at once
      - {sched.warmup_steps: [10, 40], train.epochs: [5, 20]}
    baseline: {optim.lr: 0.1, mix.mixup_alpha: 0}   # default: the first cell
    overrides: [train.epochs=3]                      # every member; ARGS adds to them

A cell's name is its settings, `lr0.1-mixup_alpha0.2` (each key's last part, the whole key
where two would read the same), so a member's run name says what it ran:
`<sweep>-lr0.1-mixup_alpha0.2-seed2`. A sweep without a grid is a seed sweep:
`<sweep>-seed2`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import load_yaml
from launch.errors import UserError
from launch.runs import BOOKKEEPING, BOOKKEEPING_PREFIXES, value_text

NAME_PART = re.compile(r"[^A-Za-z0-9._-]+")
MAX_NAME = 200  # a member's run name is a folder name (255 bytes on most filesystems)
FILE_KEYS = ("name", "seeds", "parallel", "grid", "zip", "baseline", "overrides")
NOT_SWEPT = ("seed", "run.name", "run.root")  # SEEDS varies the seed; the others place runs


@dataclass(frozen=True)
class Axis:
    """One dimension of the grid: one key, or several varied together, and the override
    texts each point gives them."""

    keys: tuple[str, ...]
    points: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Cell:
    """One combination: (key, override text) pairs in the grid's key order."""

    settings: tuple[tuple[str, str], ...]
    name: str

    @property
    def overrides(self) -> tuple[str, ...]:
        return tuple(f"{k}={v}" for k, v in self.settings)


@dataclass(frozen=True)
class Grid:
    axes: tuple[Axis, ...] = ()
    fixed: tuple[str, ...] = ()  # overrides every member gets, in order
    baseline: tuple[tuple[str, str], ...] = ()  # the baseline's settings; () = the first cell
    name: str | None = None  # from a sweep file
    seeds: int | None = None  # from a sweep file
    parallel: int | None = None  # from a sweep file
    source: str = ""  # the sweep file, if any
    cells: tuple[Cell, ...] = field(default=(), compare=False)

    @property
    def keys(self) -> list[str]:
        return [k for axis in self.axes for k in axis.keys]

    def baseline_cell(self) -> Cell:
        wanted = dict(self.baseline)
        return next(
            c for c in self.cells if all(dict(c.settings)[k] == v for k, v in wanted.items())
        )

    def identity(self) -> dict[str, Any]:
        """What makes two sweeps the same sweep (seeds aside: more seeds may be added)."""
        return {
            "axes": [
                {"keys": list(a.keys), "values": [list(p) for p in a.points]} for a in self.axes
            ],
            "fixed": [o for o in self.fixed if not bookkeeping(o)],
            "baseline": dict(self.baseline_cell().settings) if self.cells else {},
        }


def bookkeeping(override: str) -> bool:
    """An override that names, places or logs a run without changing what it trains: not part
    of what makes a sweep the same sweep."""
    key = override.partition("=")[0]
    return key.startswith(BOOKKEEPING_PREFIXES) or key in BOOKKEEPING


# ---------------------------------------------------------------- value lists


def split_values(text: str) -> list[str]:
    """`0.05,0.1` -> ['0.05', '0.1']; commas inside [], {}, () or quotes do not split."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def canonical(text: str) -> Any:
    """A value as the engine reads an override (YAML), so 0.1 and 0.10 are one value."""
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return text


def same_value(a: str, b: str) -> bool:
    """Whether two override texts give the engine one value (0.1 and 0.10 do)."""
    return repr(canonical(a)) == repr(canonical(b))


def matches(settings: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    """Whether settings ({key: text}) hold every value wanted names."""
    return all(k in settings and same_value(settings[k], v) for k, v in wanted.items())


def check_values(key: str, values: Sequence[str], where: str) -> None:
    if any(v.strip() == "" for v in values):
        raise UserError(f"{where}: {key} has an empty value in {','.join(values)!r}; drop it")
    seen: dict[str, str] = {}
    for v in values:
        same = repr(canonical(v))
        if same in seen:
            raise UserError(f"{where}: {key} lists the value {seen[same]} twice; list each once")
        seen[same] = v
    if key in NOT_SWEPT:
        fix = "SEEDS=N runs seeds 0..N-1" if key == "seed" else "give the sweep one run.name"
        raise UserError(f"{where}: {key} cannot be swept; {fix}")


# ---------------------------------------------------------------- names


def short_names(keys: Sequence[str]) -> dict[str, str]:
    """Each key's last part, or the whole key (dots as '_') where two last parts agree."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {
        k: (s if last.count(s) == 1 else k.replace(".", "_"))
        for k, s in zip(keys, last, strict=True)
    }


def name_text(value: str) -> str:
    text = NAME_PART.sub("_", value.strip("'\"[]{}() ").replace(", ", "_").replace(",", "_"))
    return text.strip("_") or "empty"


def cell_name(settings: Sequence[tuple[str, str]], shorts: Mapping[str, str]) -> str:
    return "-".join(f"{shorts[k]}{name_text(v)}" for k, v in settings)


def build_cells(axes: Sequence[Axis], where: str) -> tuple[Cell, ...]:
    shorts = short_names([k for a in axes for k in a.keys])
    cells = []
    for combo in itertools.product(*(a.points for a in axes)):
        settings = tuple(
            (k, v)
            for axis, point in zip(axes, combo, strict=True)
            for k, v in zip(axis.keys, point, strict=True)
        )
        cells.append(Cell(settings, cell_name(settings, shorts)))
    names = [c.name for c in cells]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:
        raise UserError(
            f"{where}: two cells would both be named {twice!r}; make their values differ in letters or digits"
        )
    return tuple(cells)


def member_name(base: str, cell: Cell, seed: int) -> str:
    name = f"{base}-{cell.name}-seed{seed}" if cell.name else f"{base}-seed{seed}"
    if len(name) > MAX_NAME:
        raise UserError(
            f"member run names would be {len(name)} characters ({name[:60]}...); "
            "sweep fewer settings at once or give the sweep a shorter run.name"
        )
    return name


# ---------------------------------------------------------------- the command line


def from_overrides(overrides: Sequence[str]) -> tuple[list[Axis], list[str]]:
    """(the swept settings, the fixed overrides) of ARGS' words."""
    axes, fixed = [], []
    for word in overrides:
        key, _, value = word.partition("=")
        values = split_values(value)
        if len(values) == 1:
            fixed.append(word)
            continue
        check_values(key, values, "ARGS")
        axes.append(Axis((key,), tuple((v,) for v in values)))
    return axes, fixed


# ---------------------------------------------------------------- a sweep file


def load_file(path: str) -> dict[str, Any]:
    try:
        data = load_yaml(Path(path).read_text())
    except OSError as err:
        raise UserError(
            f"SWEEP={path}: cannot read it ({err.strerror}); give a sweep file"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"SWEEP={path} is not valid YAML{where}; fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"SWEEP={path} must be a mapping with grid:, zip:, baseline: ...")
    unknown = sorted(set(map(str, data)) - set(FILE_KEYS))
    if unknown:
        raise UserError(
            f"SWEEP={path}: unknown key {unknown[0]!r}; the keys are {', '.join(FILE_KEYS)}"
        )
    return data


def _value_list(key: Any, values: Any, where: str) -> list[str]:
    if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", key):
        raise UserError(f"{where}: {key!r} is not a config key such as optim.lr")
    if not isinstance(values, list) or not values:
        raise UserError(f"{where}: {key} needs a list of values, e.g. {key}: [0.1, 0.2]")
    texts = [value_text(v) for v in values]
    check_values(key, texts, where)
    return texts


def file_axes(data: Mapping[str, Any], where: str) -> list[Axis]:
    grid = data.get("grid") or {}
    groups = data.get("zip") or []
    if not isinstance(grid, dict) or not isinstance(groups, list):
        raise UserError(f"{where}: grid: is a mapping of key: [values]; zip: a list of them")
    axes = [
        Axis((k,), tuple((t,) for t in _value_list(k, v, f"{where} grid"))) for k, v in grid.items()
    ]
    for group in groups:
        if not isinstance(group, dict) or len(group) < 2:
            raise UserError(f"{where} zip: each entry maps two or more keys to lists of one length")
        lists = {k: _value_list(k, v, f"{where} zip") for k, v in group.items()}
        lengths = {k: len(v) for k, v in lists.items()}
        if len(set(lengths.values())) > 1:
            said = ", ".join(f"{k} has {n}" for k, n in lengths.items())
            raise UserError(f"{where} zip: its lists must be of one length ({said})")
        axes.append(Axis(tuple(lists), tuple(zip(*lists.values(), strict=True))))
    return axes


def _whole(data: Mapping[str, Any], key: str, where: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{where}: {key}: {value!r} is not a whole number >= 1")
    return value


def _fixed(data: Mapping[str, Any], where: str) -> list[str]:
    fixed = data.get("overrides") or []
    if isinstance(fixed, dict):
        fixed = [f"{k}={value_text(v)}" for k, v in fixed.items()]
    if not isinstance(fixed, list) or not all(isinstance(o, str) and "=" in o for o in fixed):
        raise UserError(f"{where}: overrides: is a list of key=value, e.g. [train.epochs=3]")
    return fixed


# ---------------------------------------------------------------- the grid


def check_keys(axes: Sequence[Axis], fixed: Sequence[str], where: str) -> None:
    swept = [k for a in axes for k in a.keys]
    twice = next((k for k in swept if swept.count(k) > 1), None)
    if twice:
        raise UserError(f"{where}: {twice} is swept twice; give its values once")
    set_too = next((o for o in fixed if o.partition("=")[0] in swept), None)
    if set_too:
        key = set_too.partition("=")[0]
        raise UserError(f"{where}: {key} is swept and also set ({set_too}); drop one")


def pick_baseline(cells: Sequence[Cell], wanted: Mapping[str, Any], where: str) -> tuple:
    """The settings of the one cell `wanted` names (every key it gives, by value)."""
    if not wanted:
        return ()
    texts = {k: value_text(v) for k, v in wanted.items()}
    keys = {k for c in cells for k, _ in c.settings}
    stray = next((k for k in texts if k not in keys), None)
    if stray:
        raise UserError(f"{where}: baseline names {stray}, which is not swept; name swept keys")
    found = [c for c in cells if matches(dict(c.settings), texts)]
    if len(found) != 1:
        said = "no cell" if not found else f"{len(found)} cells"
        raise UserError(
            f"{where}: baseline {texts} matches {said}; name one cell, e.g. {dict(cells[0].settings)}"
        )
    return found[0].settings


def parse_baseline(text: str) -> dict[str, str]:
    """BASELINE='optim.lr=0.1 mix.mixup_alpha=0' as {key: text}."""
    pairs = [w.partition("=") for w in text.split()]
    if not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise UserError(f"BASELINE={text!r} is not key=value ...; e.g. BASELINE='optim.lr=0.1'")
    return {k: v for k, _, v in pairs}


def build(overrides: Sequence[str], sweep_file: str | None, baseline: str | None) -> Grid:
    data = load_file(sweep_file) if sweep_file else {}
    where = f"SWEEP={sweep_file}" if sweep_file else "ARGS"
    axes = file_axes(data, where) if sweep_file else []
    cli_axes, cli_fixed = from_overrides(overrides)
    axes += cli_axes
    fixed = [*_fixed(data, where), *cli_fixed]
    check_keys(axes, fixed, where)
    cells = build_cells(axes, where)
    wanted = parse_baseline(baseline) if baseline else (data.get("baseline") or {})
    if not isinstance(wanted, dict):
        raise UserError(f"{where}: baseline: is a mapping of swept keys to values")
    chosen = pick_baseline(cells, wanted, "BASELINE" if baseline else where)
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise UserError(f"{where}: name: is the sweep's run name, a string")
    return Grid(
        axes=tuple(axes),
        fixed=tuple(fixed),
        baseline=chosen or cells[0].settings,
        name=name,
        seeds=_whole(data, "seeds", where),
        parallel=_whole(data, "parallel", where),
        source=sweep_file or "",
        cells=cells,
    )


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What changed between two identities, each in a few words."""
    said = []
    old_axes = {tuple(a["keys"]): a["values"] for a in old.get("axes", [])}
    new_axes = {tuple(a["keys"]): a["values"] for a in new.get("axes", [])}
    for keys in [*old_axes, *(k for k in new_axes if k not in old_axes)]:
        name = "+".join(keys)
        before, after = old_axes.get(keys), new_axes.get(keys)
        if before == after:
            continue
        show = lambda v: "not swept" if v is None else ",".join("/".join(p) for p in v)  # noqa: E731
        said.append(f"{name} was {show(before)}, now {show(after)}")
    if old.get("fixed") != new.get("fixed"):
        said.append(
            f"the fixed overrides were {' '.join(old.get('fixed', [])) or 'none'}, "
            f"now {' '.join(new.get('fixed', [])) or 'none'}"
        )
    if old.get("baseline") != new.get("baseline") and not said:
        said.append(f"the baseline was {old.get('baseline')}, now {new.get('baseline')}")
    for key in ("recipe", "config"):
        if old.get(key) != new.get(key):
            said.append(f"{key} was {old.get(key) or 'none'!r}, now {new.get(key) or 'none'!r}")
    return said
