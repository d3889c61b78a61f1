"""The statistics of a comparison over seeds, from scipy.stats: per cell the mean, the sample
standard deviation and the 95% confidence interval of the mean (Student's t), and each cell
against the baseline by Welch's t-test (unequal variances), its p-value adjusted for the
number of cells compared (Benjamini-Hochberg) before it is called significant.

One run per setting says nothing: seeds differ by more than most changes being judged. So a
cell with fewer than two finished seeds is "too few seeds to tell", never a winner.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from launch.errors import UserError

LEVEL = 0.95  # of every confidence interval
ALPHA = 0.05  # a difference is significant below this adjusted p-value
FEW = 3  # below this many seeds a cell that cannot be told apart is said to have too few


class NoScipy(UserError):
    """scipy is not installed: the comparison cannot be made (one line, code 1)."""


def _scipy_stats():
    try:
        from scipy import stats  # optional: only sweeps' and comparisons' reports need it
    except ImportError:
        raise NoScipy(
            "the comparison needs scipy, which is not installed here: pip install scipy, or "
            "use the project's venv (make venv installs requirements.lock)",
            code=1,
        ) from None
    return stats


def require_scipy() -> None:
    """Raises NoScipy before a sweep starts training members it could not compare."""
    _scipy_stats()


@dataclass(frozen=True)
class Summary:
    """Of one cell's values: n, mean, sample std (n - 1) and the mean's 95% interval; None
    where n is too small for it (no std or interval for one value)."""

    n: int
    mean: float | None = None
    std: float | None = None
    low: float | None = None
    high: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def describe(values: Sequence[float]) -> Summary:
    n = len(values)
    if n == 0:
        return Summary(0)
    mean = statistics.fmean(values)
    if n == 1:
        return Summary(1, mean)
    std = statistics.stdev(values)
    if std == 0:  # every seed gave the same value: the interval is that value
        return Summary(n, mean, 0.0, mean, mean)
    with warnings.catch_warnings():  # nearly equal values: scipy warns, the result stands
        warnings.simplefilter("ignore", RuntimeWarning)
        interval = _scipy_stats().ttest_1samp(values, 0.0).confidence_interval(LEVEL)
    return Summary(n, mean, std, float(interval.low), float(interval.high))


@dataclass(frozen=True)
class Comparison:
    """A cell against the baseline: the difference of means (cell - baseline) with its Welch
    95% interval, Welch's t, degrees of freedom and two-sided p-value, the p-value adjusted
    for the number of comparisons, and the verdict in words."""

    difference: float | None = None
    low: float | None = None
    high: float | None = None
    t: float | None = None
    df: float | None = None
    p: float | None = None
    p_adjusted: float | None = None
    verdict: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def welch(cell: Sequence[float], baseline: Sequence[float]) -> Comparison:
    """Welch's t-test of cell against baseline (scipy.stats.ttest_ind, equal_var=False);
    no verdict yet (see judge). Fewer than two values on either side: only the difference."""
    if not cell or not baseline:
        return Comparison()
    difference = statistics.fmean(cell) - statistics.fmean(baseline)
    if len(cell) < 2 or len(baseline) < 2:
        return Comparison(difference)
    if statistics.stdev(cell) == 0 and statistics.stdev(baseline) == 0:
        # No spread on either side: the test is undefined (scipy says p = 0 for any
        # difference), and the difference is exact.
        return Comparison(difference, difference, difference)
    stats = _scipy_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(cell, baseline, equal_var=False)
        interval = result.confidence_interval(LEVEL)
    return Comparison(
        difference,
        float(interval.low),
        float(interval.high),
        float(result.statistic),
        float(result.df),
        float(result.pvalue),
    )


def adjust(ps: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (scipy.stats.false_discovery_control): with many
    cells, some raw p-values fall below 0.05 by chance alone."""
    if len(ps) <= 1:
        return list(ps)
    return [float(p) for p in _scipy_stats().false_discovery_control(list(ps), method="bh")]


def judge(
    comparisons: Sequence[Comparison], sizes: Sequence[tuple[int, int]], higher_is_better: bool
) -> list[Comparison]:
    """Each comparison with its adjusted p-value and verdict; sizes are (cell n, baseline n)."""
    tested = [i for i, c in enumerate(comparisons) if c.p is not None]
    adjusted = dict(zip(tested, adjust([comparisons[i].p for i in tested]), strict=True))
    judged = []
    for i, (c, (n, n_base)) in enumerate(zip(comparisons, sizes, strict=True)):
        c = replace(c, p_adjusted=adjusted.get(i))
        judged.append(replace(c, verdict=verdict(c, n, n_base, higher_is_better)))
    return judged


def verdict(c: Comparison, n: int, n_base: int, higher_is_better: bool) -> str:
    fewest = min(n, n_base)
    if fewest < 2:
        return f"too few seeds to tell (n={fewest}; at least 2 per cell, {FEW}+ advised)"
    better = (c.difference or 0) > 0 if higher_is_better else (c.difference or 0) < 0
    if c.p is None:  # no spread on either side
        if c.difference == 0:
            return "the same: every seed gave the same value in both"
        return ("better" if better else "worse") + " (every seed gave the same value in each)"
    if c.p_adjusted is not None and c.p_adjusted < ALPHA:
        return ("better" if better else "worse") + f" (p={pvalue_text(c.p_adjusted)})"
    said = f"no significant difference (p={pvalue_text(c.p_adjusted)})"
    if fewest < FEW:
        said += f"; too few seeds to tell (n={fewest}): run more seeds"
    return said


def pvalue_text(p: float | None) -> str:
    if p is None or math.isnan(p):
        return "n/a"
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"
