"""The report of cells (a sweep's, or runs grouped by `make compare`): report.md, report.json
and a chart, and the `compare` command itself.

`make compare RUNS="runs/digits/a runs/digits/b ..."` (or `python -m launch compare RUN...`)
groups finished runs by the settings in which they differ (the seed aside; the data they
trained on, env.json's fingerprints, is one such setting), so runs made by hand, by a sweep
or on another machine are judged the same way, and runs on other data are never pooled. The baseline is the first
run's group unless BASELINE='key=value ...' names another. The files land in the runs'
common parent as compare-<run names>.md, .json and .png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.results import PERCENT, metric_text
from launch import grid, hardware, runs
from launch.analysis import cells as cell_stats
from launch.analysis import charts, report, stats
from launch.analysis.cells import CellResults
from launch.errors import UserError, printable
from launch.runs import Headline, Member

SEED = "seed"


@dataclass
class Report:
    """What a report says besides its cells: its title and the record that reproduces it."""

    title: str
    headline: Headline
    record: dict[str, Any] = field(default_factory=dict)  # grid, command, git ... (report.json)
    keys: list[str] = field(default_factory=list)  # the settings that tell cells apart
    curve: str | None = None  # a swept number: the chart draws the headline against it


# ---------------------------------------------------------------- numbers as text


def num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.{digits}f}"


def signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.4f}"


def interval(low: float | None, high: float | None, fmt=num) -> str:
    return "n/a" if low is None or high is None else f"[{fmt(low)}, {fmt(high)}]"


def in_unit(key: str, signed: bool = False):
    """The headline's numbers in the training log's unit (top-1 in percent)."""
    return lambda v: "n/a" if v is None else metric_text(key, v, signed)


def bounded(key: str, low: float | None, high: float | None) -> tuple[float | None, float | None]:
    """An interval of a fraction (top-1) within [0, 1]: a spread wider than the scale is not a
    value the metric can take."""
    if key not in PERCENT or low is None or high is None:
        return low, high
    return max(low, 0.0), min(high, 1.0)


def seconds_text(v: float | None) -> str:
    """A time: never below zero (an interval's lower end clipped where the spread is wide)."""
    return num(None if v is None else max(v, 0.0), 1)


def counts_text(cell: CellResults) -> str:
    return ", ".join(f"{n} {status}" for status, n in cell.counts().items()) or "none"


def escape(text: str) -> str:
    return printable(text).replace("|", "\\|")


# ---------------------------------------------------------------- the Markdown


def cell_rows(ranked: list[CellResults], rep: Report) -> list[str]:
    key = rep.headline.key
    head = [
        "rank",
        "cell",
        *rep.keys,
        "seeds",
        f"{key} mean",
        "std",
        "95% CI",
        "time (s) mean [95% CI]",
    ]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---:|" + "---|" * (len(rep.keys) + 2) + "---:|" * 4,
    ]
    for i, cell in enumerate(ranked, 1):
        s, t = cell.summary(key), cell.summary("seconds")
        name = cell.name + (" (baseline)" if cell.baseline else "")
        settings = [str(cell.settings.get(k, runs.UNSET)) for k in rep.keys]
        time = f"{num(t.mean, 1)} {interval(t.low, t.high, seconds_text)}"
        value = in_unit(key)
        row = [
            str(i),
            name,
            *settings,
            counts_text(cell),
            value(s.mean),
            value(s.std),
            interval(*bounded(key, s.low, s.high), value),
            time,
        ]
        lines.append("| " + " | ".join(escape(x) for x in row) + " |")
    return lines


def comparison_rows(
    ranked: list[CellResults], judged: Mapping[str, stats.Comparison], key: str = ""
) -> list[str]:
    head = ["cell", "difference", "95% CI", "t", "df", "p", "p (BH)", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * 6 + "---|"]
    for cell in ranked:
        if cell.baseline:
            continue
        c = judged[cell.name]
        row = [
            cell.name,
            in_unit(key, True)(c.difference),
            interval(c.low, c.high, in_unit(key, True)),
            num(c.t, 2),
            num(c.df, 1),
            stats.pvalue_text(c.p),
            stats.pvalue_text(c.p_adjusted),
            c.verdict,
        ]
        lines.append("| " + " | ".join(escape(x) for x in row) + " |")
    return lines


def member_rows(cells: list[CellResults], key: str) -> list[str]:
    lines = [
        f"| member | cell | seed | status | {key} | time (s) | last line |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for cell in cells:
        for m in cell.members:
            summary = m.summary or {}
            value = summary.get(key)
            row = [
                m.name,
                cell.name,
                "n/a" if m.seed is None else str(m.seed),
                m.status,
                metric_text(key, value) if cell_stats.is_number(value) else "–",
                num(summary.get("seconds"), 1)
                if cell_stats.is_number(summary.get("seconds"))
                else "–",
                m.last_line or "",
            ]
            lines.append("| " + " | ".join(escape(x) for x in row) + " |")
    return lines


def method_text(n_compared: int) -> str:
    adjusted = (
        f" p (BH) is the p-value adjusted for the {n_compared} comparisons "
        "(Benjamini-Hochberg); a difference is called significant when it is below "
        f"{stats.ALPHA}."
        if n_compared > 1
        else f" A difference is called significant when p is below {stats.ALPHA}."
    )
    return (
        "Means with the sample standard deviation (n - 1); each interval is the 95% "
        "confidence interval of the mean (Student's t). Each cell is compared with the "
        "baseline by Welch's t-test (two-sided, unequal variances; scipy.stats), the "
        "difference being cell minus baseline." + adjusted + " Only finished seeds count."
    )


def markdown(cells: list[CellResults], rep: Report, chart: str | None) -> str:
    key = rep.headline.key
    ranked = cell_stats.rank(cells, rep.headline)
    judged = cell_stats.compare(cells, rep.headline)
    base = next(c for c in cells if c.baseline)
    direction = "higher" if rep.headline.higher_is_better else "lower"
    lines = [
        f"# {rep.title}",
        "",
        f"Headline: {key} ({direction} is better). Baseline: {base.name}.",
    ]
    lines += [f"Command: `{rep.record['command']['make']}`"] if "command" in rep.record else []
    lines += [f"Git: {rep.record['git_text']}"] if "git_text" in rep.record else []
    lines += ["", rep.record["hardware_note"]] if rep.record.get("hardware_note") else []
    lines += ["", rep.record["data_note"]] if rep.record.get("data_note") else []
    lines += (
        ["", f"![Each cell's seeds and their mean with its 95% interval]({chart})"] if chart else []
    )
    lines += ["", "## Cells, best first", "", *cell_rows(ranked, rep)]
    if len(cells) > 1:
        lines += [
            "",
            f"## Against the baseline ({base.name})",
            "",
            *comparison_rows(ranked, judged, key),
        ]
    lines += ["", method_text(len(cells) - 1), "", "## Members", "", *member_rows(cells, key), ""]
    return "\n".join(lines)


def data(cells: list[CellResults], rep: Report, chart: str | None) -> dict[str, Any]:
    judged = cell_stats.compare(cells, rep.headline)
    key = rep.headline.key
    return {
        **rep.record,
        "title": rep.title,
        "headline": {"key": key, "higher_is_better": rep.headline.higher_is_better},
        "baseline": next(c.name for c in cells if c.baseline),
        "ranking": [c.name for c in cell_stats.rank(cells, rep.headline)],
        "cells": [
            {
                "name": c.name,
                "settings": c.settings,
                "counts": c.counts(),
                key: c.summary(key).as_dict(),
                "seconds": c.summary("seconds").as_dict(),
                "vs_baseline": judged[c.name].as_dict() if c.name in judged else None,
                "members": [
                    {
                        "run": m.name,
                        "seed": m.seed,
                        "status": m.status,
                        "summary": m.summary,
                        "last_line": m.last_line,
                    }
                    for m in c.members
                ],
            }
            for c in cells
        ],
        "statistics": {
            "interval": stats.LEVEL,
            "alpha": stats.ALPHA,
            "std": "sample (n - 1)",
            "test": "Welch's t-test, two-sided (scipy.stats.ttest_ind, equal_var=False)",
            "adjustment": "Benjamini-Hochberg (scipy.stats.false_discovery_control)",
        },
        "chart": chart,
    }


def write(cells: list[CellResults], rep: Report, md: Path, js: Path, png: Path) -> str:
    """The three files (the chart left out, with a warning, where it cannot be drawn); returns
    the Markdown."""
    chart: str | None = png.name
    try:
        charts.draw_cells(cells, rep.headline, png, rep.title, curve=rep.curve)
    except charts.NoMatplotlib as err:
        print(f"launch: warning: no chart: {err}", file=sys.stderr)
        chart = None
    text = markdown(cells, rep, chart)
    md.write_text(text)
    js.write_text(json.dumps(data(cells, rep, chart), indent=2, default=str) + "\n")
    return text


def headline_of(members: list[Member], envs: Mapping[str, dict]) -> Headline:
    """The headline the members recorded (the first that did), else the old rule."""
    for m in members:
        found = runs.recorded_headline(m.summary, envs.get(m.name))
        if found is not None:
            return found
    first = members[0]
    return runs.find_headline(first.summary, envs.get(first.name), [])


# ---------------------------------------------------------------- `make compare`


def group(found: list[runs.RunRecord]) -> tuple[list[str], list[CellResults]]:
    """Runs that differ only in their seed form one cell, in the order of their first run; a
    second finished run with a cell's settings and seed is a duplicate, not counted."""
    keys = [k for k in runs.differing(found) if k != SEED]
    cells: dict[str, CellResults] = {}
    for run in found:
        values = runs.settings(run)
        settings = {k: values.get(k, runs.UNSET) for k in keys}
        name = " ".join(runs.overrides(run, keys)) or "all"
        seed = run.config.get(SEED)
        member = Member(
            name=run.name,
            seed=seed if isinstance(seed, int) else None,
            path=run.path,
            status=runs.FINISHED if run.summary is not None else "unfinished",
            summary=run.summary,
            last_line=None if run.summary is not None else report.status(run),
        )
        cell = cells.setdefault(name, CellResults(name, settings))
        twin = next((m for m in cell.members if m.finished and m.seed == member.seed), None)
        if member.finished and member.seed is not None and twin is not None:
            # the same settings and seed give the same result: a second sample it is not
            member.status, member.last_line = "duplicate", f"same settings and seed as {twin.name}"
        cell.members.append(member)
    return keys, list(cells.values())


def setting_texts(cell: CellResults) -> dict[str, str]:
    """A group's settings as overrides write them, to match BASELINE's texts against."""
    return {k: runs.value_text(v) for k, v in cell.settings.items()}


def mark_baseline(cells: list[CellResults], text: str | None) -> None:
    if not text:
        cells[0].baseline = True
        return
    wanted = grid.parse_baseline(text)
    found = [c for c in cells if grid.matches(setting_texts(c), wanted)]
    if len(found) != 1:
        said = "no group" if not found else f"{len(found)} groups"
        names = "; ".join(c.name for c in cells)
        raise UserError(f"BASELINE={text!r} matches {said}; the groups are: {names}")
    found[0].baseline = True


def title_of(cells: list[CellResults], keys: list[str]) -> str:
    n = sum(len(c.members) for c in cells)
    groups = f"{len(cells)} group" + ("s" if len(cells) > 1 else "")
    return f"Comparison of {n} runs in {groups}" + (f" by {', '.join(keys)}" if keys else "")


def commits_text(found: list[runs.RunRecord]) -> str:
    """The commits the runs were trained at (each once)."""
    return ", ".join(sorted({report.commit_text(r.env) for r in found}))


def check_one_recipe(found: list[runs.RunRecord]) -> None:
    """Runs of different recipes are judged by different tasks on different data: their
    headlines are not one quantity, so ranking them against each other means nothing."""
    first: dict[str, runs.RunRecord] = {}
    for run in found:
        if run.recipe is not None:
            first.setdefault(run.recipe, run)
    if len(first) > 1:
        named = ", ".join(f"{run.name} is {recipe}" for recipe, run in first.items())
        recipe = next(iter(first))
        same = " ".join(str(run.path) for run in found if run.recipe == recipe)
        raise UserError(
            f"cannot compare runs of different recipes ({named}); compare runs of one "
            f'recipe, e.g. RUNS="{same}"'
        )


def with_records(args: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    """The runs to compare: each one named, and of a pattern's matches those that recorded a
    step or an evaluation (a run that failed at its start, a member still queued, a sweep's
    folder are left out, named on stderr, instead of ending the comparison)."""
    paths = report.run_paths(args, env, command="compare")
    named = set(args.overrides) | set(shlex.split(env.get("RUNS", "")))
    empty = [p for p in paths if p not in named and not has_records(Path(p))]
    if empty:
        print(
            f"compare: left out {len(empty)} matched folder(s) with no training records: "
            f"{', '.join(empty)}",
            file=sys.stderr,
        )
    kept = [p for p in paths if p not in empty]
    if not kept:
        raise UserError("no run among the matches has training records; name finished runs")
    return kept


def has_records(path: Path) -> bool:
    """A finished run (summary.json), or one that recorded a step or an evaluation."""
    metrics = path / runs.MARKER
    if not metrics.is_file():
        return False
    if (path / "summary.json").is_file():
        return True
    found = runs.read_metrics(metrics)
    return bool(found.train or found.eval)


def main(args: argparse.Namespace, env: Mapping[str, str], dry: bool) -> int:
    found = report.read_runs(with_records(args, env))
    check_one_recipe(found)
    parent = report.common_parent(found)
    stem = report.output_stem(found).replace("report-", "compare-", 1)
    md, js, png = (parent / f"{stem}{ext}" for ext in (".md", ".json", ".png"))
    keys, cells = group(found)
    mark_baseline(cells, env.get("BASELINE") or getattr(args, "baseline", None))
    if dry:
        print(f"{md}\n{js}\n{png}\n(dry run: nothing written)")
        return 0
    stats.require_scipy()
    members = [m for c in cells for m in c.members]
    headline = headline_of(members, {r.name: r.env for r in found})
    record = {"runs": [str(r.path) for r in found], "git_text": commits_text(found)}
    record["hardware_note"] = hardware.note([hardware.of(r.env) for r in found])
    record["data_note"] = runs.data_note(found)
    rep = Report(title_of(cells, keys), headline, record, keys, cell_stats.numeric_axis(cells))
    try:
        print(write(cells, rep, md, js, png), end="")
    except OSError as err:
        raise UserError(
            f"cannot write the comparison in {parent} ({err.strerror}); make it writable", code=1
        ) from None
    print(f"{md}\n{js}\n{png}", file=sys.stderr)
    return 0
