"""Cells: runs grouped by their settings, each group a set of seeds. A sweep's cells are its
grid's combinations; `make compare` groups finished runs by the settings in which they differ.
Both report the same way: per cell the headline metric's and the time's mean, sample std and
95% interval, the cells ranked, each against the baseline by Welch's t-test
(launch.analysis.stats). A cell's members are launch.runs.Member, as a sweep's launch finds
them standing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from launch.analysis import stats
from launch.runs import Headline, Member


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class CellResults:
    """Runs that differ only in their seed. `settings`: what sets this cell apart, as
    {key: value} in the grid's (or the comparison's) key order."""

    name: str
    settings: dict[str, Any]
    members: list[Member] = field(default_factory=list)
    baseline: bool = False

    def points(self, key: str) -> list[tuple[int | None, float]]:
        """(seed, value) of the finished members whose summary has `key` as a number."""
        return [
            (m.seed, m.summary[key])
            for m in self.members
            if m.finished and is_number((m.summary or {}).get(key))
        ]

    def values(self, key: str) -> list[float]:
        return [value for _, value in self.points(key)]

    def summary(self, key: str) -> stats.Summary:
        return stats.describe(self.values(key))

    def counts(self) -> dict[str, int]:
        """How many members stand in each status, in a fixed order."""
        order = ("finished", "unfinished", "failed", "queued", "missing", "duplicate")
        found = {status: sum(m.status == status for m in self.members) for status in order}
        return {k: v for k, v in found.items() if v}


def rank(cells: list[CellResults], headline: Headline) -> list[CellResults]:
    """Best mean headline first; cells with no finished seed last, in their own order."""

    def key(cell: CellResults):
        mean = cell.summary(headline.key).mean
        if mean is None:
            return (1, 0.0)
        return (0, -mean if headline.higher_is_better else mean)

    return sorted(cells, key=key)


def compare(cells: list[CellResults], headline: Headline) -> dict[str, stats.Comparison]:
    """Each cell but the baseline against it, by cell name, judged together (the p-values
    adjusted for how many cells are compared)."""
    base = next(c for c in cells if c.baseline)
    others = [c for c in cells if not c.baseline]
    base_values = base.values(headline.key)
    raw = [stats.welch(c.values(headline.key), base_values) for c in others]
    sizes = [(len(c.values(headline.key)), len(base_values)) for c in others]
    judged = stats.judge(raw, sizes, headline.higher_is_better)
    return {c.name: j for c, j in zip(others, judged, strict=True)}


def numeric_axis(cells: list[CellResults]) -> str | None:
    """The first setting whose values are all numbers and take at least two values: a curve
    of the headline against it says more than bars."""
    if not cells:
        return None
    for key in cells[0].settings:
        values = [c.settings.get(key) for c in cells]
        if all(is_number(v) for v in values) and len(set(values)) > 1:
            return key
    return None
