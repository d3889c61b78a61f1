"""How a sweep (and `make compare`) judges its cells against the baseline: every cell is
compared by Welch's t-test and the p-values of all the comparisons are adjusted together
(Benjamini-Hochberg, as scipy.stats.false_discovery_control) before a difference is called
significant. With several cells, a raw p-value below 0.05 is not enough: the verdict and the
report follow the adjusted one."""

from pathlib import Path

import pytest
import scipy.stats

from launch.analysis import cells as C
from launch.analysis import compare, stats
from launch.runs import FINISHED, Headline, Member

TOP1 = Headline("top1", higher_is_better=True)
BASELINE = [0.900, 0.905, 0.910, 0.915]
# One cell a little above the baseline (its raw p falls below 0.05 alone), two like it.
OTHERS = {
    "a-little-better": [0.912, 0.918, 0.924, 0.930],
    "alike": [0.898, 0.907, 0.913, 0.912],
    "alike-too": [0.903, 0.909, 0.906, 0.917],
}


def cell(name: str, values: list[float], baseline: bool = False) -> C.CellResults:
    members = [
        Member(f"{name}-s{seed}", seed, Path(name), FINISHED, {"top1": value})
        for seed, value in enumerate(values)
    ]
    return C.CellResults(name, {}, members, baseline)


def sweep_cells() -> list[C.CellResults]:
    return [cell("base", BASELINE, baseline=True)] + [cell(n, v) for n, v in OTHERS.items()]


def scipy_p_values() -> tuple[list[float], list[float]]:
    """(raw, Benjamini-Hochberg adjusted) p-values of the cells against the baseline."""
    raw = [scipy.stats.ttest_ind(v, BASELINE, equal_var=False).pvalue for v in OTHERS.values()]
    return raw, list(scipy.stats.false_discovery_control(raw, method="bh"))


def test_three_comparisons_are_judged_on_their_benjamini_hochberg_p_values():
    raw, adjusted = scipy_p_values()
    assert raw[0] < stats.ALPHA < adjusted[0]  # the case where the adjustment decides
    judged = C.compare(sweep_cells(), TOP1)
    assert [judged[n].p for n in OTHERS] == pytest.approx(raw, rel=1e-9)
    assert [judged[n].p_adjusted for n in OTHERS] == pytest.approx(adjusted, rel=1e-9)
    said = f"no significant difference (p={stats.pvalue_text(adjusted[0])})"
    assert judged["a-little-better"].verdict == said


def test_the_same_cell_compared_alone_is_called_better():
    """The verdict above is the adjustment's doing: one comparison is not adjusted."""
    raw, _ = scipy_p_values()
    alone = C.compare(sweep_cells()[:2], TOP1)["a-little-better"]
    assert alone.p_adjusted == pytest.approx(raw[0], rel=1e-9)
    assert alone.verdict == f"better (p={stats.pvalue_text(raw[0])})"


def test_the_sweep_report_records_the_adjusted_p_and_its_verdict():
    _, adjusted = scipy_p_values()
    found = sweep_cells()
    report = compare.data(found, compare.Report("sweep", TOP1), None)
    against = {c["name"]: c["vs_baseline"] for c in report["cells"]}
    assert against["base"] is None
    for name, p in zip(OTHERS, adjusted, strict=True):
        assert against[name]["p_adjusted"] == pytest.approx(p, rel=1e-9)
    assert against["a-little-better"]["verdict"].startswith("no significant difference")
    text = compare.markdown(found, compare.Report("sweep", TOP1), None)
    assert f"| {stats.pvalue_text(adjusted[0])} | no significant difference" in text
