"""Charts from run directories: the curves of one or more runs (`launch report`), and the cells
of a sweep or a comparison side by side (each seed a point, each cell's 95% interval). Drawn on matplotlib's Agg
canvas (no display needed, no pyplot state) at a fixed size and dpi in matplotlib's bundled
font, so a chart is the same picture, of the same size, on a laptop, a CPU-only cluster node
and in the container.
"""

from __future__ import annotations

import contextlib
import re
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from launch.errors import UserError
from launch.runs import Headline, RunRecord

if TYPE_CHECKING:
    from launch.analysis.cells import CellResults
    from launch.analysis.stats import Summary

DPI = 100
RUNS_PX = (1500, 1000)  # (width, height) of a report's chart
CELLS_PX = (1500, 500)  # of a chart of cells (a sweep's, a comparison's)
SPREAD = 0.2  # a cell's seeds spread over its column's x ± SPREAD
STYLE = {"font.family": "DejaVu Sans", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3}
NOT_METRICS = ("kind", "step", "epoch", "count", "loss")
STYLES = ("-", ":", "-.", "--")  # one per evaluation metric, the headline solid
TRAIN_PANELS = (  # record key, title
    ("lr", "learning rate"),
    ("samples_per_s", "samples/s"),
    ("data_wait", "data-wait fraction (time waiting for the loader)"),
)


class NoMatplotlib(UserError):
    """matplotlib is not installed: no chart, said in one line (code 1)."""


def metric_label(key: str) -> str:
    return re.sub(r"^top(\d+)$", r"top-\1", key)


@contextlib.contextmanager
def _canvas(path: Path, size_px: tuple[int, int], cols: int, rows: int = 1) -> Iterator:
    """A figure of exactly size_px pixels, saved to path as PNG when the block ends. matplotlib
    is imported here: launch's other commands never pay for it."""
    try:
        import matplotlib  # optional: only charts need it
    except ImportError:
        raise NoMatplotlib(
            "the charts need matplotlib, which is not installed here: pip install matplotlib, "
            "or use the project's venv (make venv installs requirements.lock)",
            code=1,
        ) from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional
    from matplotlib.figure import Figure  # optional

    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(size_px[0] / DPI, size_px[1] / DPI), dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        yield fig, list(fig.subplots(rows, cols, squeeze=False).ravel())
        fig.savefig(path, dpi=DPI, format="png")


def _percent(ax) -> None:
    from matplotlib.ticker import PercentFormatter  # optional

    ax.yaxis.set_major_formatter(PercentFormatter(1.0))


def _is_value(value) -> bool:
    return isinstance(value, int | float)


def _line(ax, records: list[dict], key: str, colour: str, style: str, marker=None) -> None:
    points = [(r["step"], r[key]) for r in records if _is_value(r.get(key))]
    if points:
        ax.plot(*zip(*points, strict=True), color=colour, linestyle=style, marker=marker, ms=4)


def _key(ax, entries: list[tuple[str, str]], marker=None) -> None:
    """A grey legend saying which line style means what."""
    for style, label in entries:
        ax.plot([], [], color="grey", linestyle=style, marker=marker, label=label)
    ax.legend(loc="best", fontsize=8)


def _finish(ax, title: str, empty: str) -> None:
    from matplotlib.ticker import MaxNLocator  # optional

    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    if not ax.lines or all(len(line.get_xdata()) == 0 for line in ax.lines):
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="grey")


def fractions(values: Iterable[float], headline: Headline) -> bool:
    """Whether an axis of evaluation metrics reads as percent: the headline is higher-is-better
    and every value drawn is a fraction in [0, 1], as accuracies are."""
    values = list(values)
    return headline.higher_is_better and bool(values) and all(0 <= v <= 1 for v in values)


def eval_metrics(runs: list[RunRecord], headline: str) -> list[str]:
    """The evaluation metrics the runs recorded, the headline first (drawn solid)."""
    found = {
        k
        for run in runs
        for r in run.metrics.eval
        for k, v in r.items()
        if k not in NOT_METRICS and isinstance(v, int | float)
    }
    ordered = [headline] * (headline in found) + sorted(found - {headline})
    return ordered[: len(STYLES)]


def train_empty_text(runs: list[RunRecord]) -> str:
    """What a training panel with nothing to draw says. A run with evaluations or a summary
    has records, only none of training: it ended before its first training record, which the
    engine writes every log.every_steps steps."""
    if any(run.metrics.train for run in runs):
        return "not recorded"
    if not any(run.metrics.eval or run.summary is not None for run in runs):
        return "no records yet"
    every = sorted({str(run.config.get("log.every_steps", "?")) for run in runs})
    return (
        f"no training records: shorter than log.every_steps={'/'.join(every)}\n"
        "(the evaluations are in the loss and evaluation panels)"
    )


def draw_runs(
    runs: list[RunRecord], labels: list[str], headline: Headline, path: Path, title: str
) -> Path:
    """Six panels against optimizer steps: loss (training and evaluation), evaluation metrics,
    learning rate, samples/s, data-wait fraction, and the legend naming each run's colour."""
    metrics = eval_metrics(runs, headline.metric)
    drawn = [r[m] for run in runs for r in run.metrics.eval for m in metrics if _is_value(r.get(m))]
    with _canvas(path, RUNS_PX, cols=3, rows=2) as (fig, axes):
        loss, evals, *train_axes, key = axes
        fig.suptitle(title)
        for i, run in enumerate(runs):
            colour = f"C{i % 10}"
            _line(loss, run.metrics.train, "loss", colour, "-")
            _line(loss, run.metrics.eval, "loss", colour, "--", marker="o")
            for metric, style in zip(metrics, STYLES, strict=False):
                _line(evals, run.metrics.eval, metric, colour, style, marker="o")
            for ax, (name, _) in zip(train_axes, TRAIN_PANELS, strict=True):
                _line(ax, run.metrics.train, name, colour, "-")
            key.plot([], [], color=colour, linewidth=3, label=textwrap.fill(labels[i], 60))
        _key(loss, [("-", "training"), ("--", "evaluation")])
        _finish(loss, "loss", "no records yet")  # evaluations draw their loss here
        if metrics:
            _key(evals, [(s, metric_label(m)) for m, s in zip(metrics, STYLES, strict=False)], "o")
        if fractions(drawn, headline):
            _percent(evals)
        _finish(evals, "evaluation, once an epoch", "no evaluation yet")
        for ax, (_, title_text) in zip(train_axes, TRAIN_PANELS, strict=True):
            _finish(ax, title_text, train_empty_text(runs))
        _percent(train_axes[-1])
        key.axis("off")
        key.legend(loc="upper left", fontsize=8, title="runs (what differs)", frameon=False)
    return path


def draw_cells(
    cells: list[CellResults], headline: Headline, path: Path, title: str, curve: str | None = None
) -> Path:
    """Three panels: each cell's final headline metric per seed with the mean and its 95%
    interval, the baseline marked; the mean against the swept number `curve` (a setting whose
    values are numbers), one line per combination of the other settings; and each cell's time."""
    drawn = [v for cell in cells for v in cell.values(headline.key)]
    with _canvas(path, CELLS_PX, cols=3) as (fig, (final_ax, curve_ax, time_ax)):
        fig.suptitle(title)
        _cell_finals(final_ax, cells, headline)
        _cell_curve(curve_ax, cells, headline, curve)
        _cell_times(time_ax, cells)
        if fractions(drawn, headline):
            _percent(final_ax)
            if curve is not None:
                _percent(curve_ax)
    return path


def _say(ax, text: str) -> None:
    """Grey text in the middle of a panel that has nothing to draw."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")


def _spread(n: int) -> list[float]:
    """x offsets of n seeds in one column, evenly over ± SPREAD."""
    if n < 2:
        return [0.0] * n
    return [SPREAD * (2 * i / (n - 1) - 1) for i in range(n)]


def _interval(
    ax, x: float, summary: Summary, colour: str, marker: str, label: str | None = None
) -> bool:
    """A cell's mean as a marker, with its 95% interval as an error bar where there is one;
    whether there was a mean to draw."""
    if summary.mean is None:
        return False
    yerr = None
    if summary.low is not None and summary.high is not None:
        yerr = [[summary.mean - summary.low], [summary.high - summary.mean]]
    size = 16 if marker == "_" else 6
    ax.errorbar(
        [x],
        [summary.mean],
        yerr=yerr,
        fmt=marker,
        color=colour,
        ms=size,
        mew=2,
        capsize=5,
        elinewidth=1.5,
        zorder=2,
        label=label,
    )
    return True


def _wrap(text: str, width: int, lines: int) -> str:
    """text in lines of at most width characters, broken after a comma or at a space where it
    can be (a setting's key=value stays whole); past `lines` lines, cut with "…"."""
    out = [""]
    for token in re.findall(r"[^,\s]*[,\s]+|[^,\s]+", text):
        if out[-1] and len(out[-1]) + len(token.rstrip()) > width:
            out.append("")
        out[-1] += token
    out = [part for line in out for part in textwrap.wrap(line, width) or [""]]
    if len(out) > lines:
        out = [*out[: lines - 1], out[lines - 1][: width - 1] + "…"]
    return "\n".join(out)


def _cell_ticks(ax, cells: list[CellResults]) -> None:
    """The cells' names under their columns, wrapped, the baseline's in bold and saying so:
    level while they fit side by side, else slanted (one line each when there are many)."""
    n = max(len(cells), 1)
    labels = [_wrap(c.name, 22, 2) + "\n(baseline)" * c.baseline for c in cells]
    widest = max((len(line) for text in labels for line in text.splitlines()), default=0)
    slanted = widest * 6 > 380 / n  # about 6 px a character, 380 px of axis
    if slanted:
        names = ["(baseline) " * c.baseline + c.name for c in cells]
        labels = [_wrap(name, 30, 2 if n <= 10 else 1) for name in names]
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(
        labels,
        rotation=45 if slanted else 0,
        ha="right" if slanted else "center",
        rotation_mode="anchor",
        fontsize=8,
    )
    for label, cell in zip(ax.get_xticklabels(), cells, strict=True):
        label.set_fontweight("bold" if cell.baseline else "normal")
    ax.set_xlim(-0.6, len(cells) - 0.4)
    ax.grid(False, axis="x")


def _cell_finals(ax, cells: list[CellResults], headline: Headline) -> None:
    label = metric_label(headline.metric)
    said = False  # the legend names the mean's marker once
    for x, cell in enumerate(cells):
        values = cell.values(headline.key)
        xs = [x + dx for dx in _spread(len(values))]
        ax.scatter(xs, values, color="C0", s=22, zorder=3)
        summary = cell.summary(headline.key)
        legend = "_" if said else "mean, 95% interval"  # "_": not in the legend
        said = _interval(ax, x, summary, "black", "_", legend) or said
        if cell.baseline and summary.mean is not None:
            ax.axhline(
                summary.mean,
                color="grey",
                linestyle="--",
                linewidth=1,
                zorder=1,
                label="baseline mean",
            )
    _cell_ticks(ax, cells)
    ax.set_title(f"final {label} per cell")
    ax.set_xlabel("cell (a point per finished seed)")
    if said:
        ax.legend(loc="best", fontsize=8)
    else:
        _say(ax, "no finished seeds")


def _combinations(cells: list[CellResults], curve: str) -> dict[str, list[CellResults]]:
    """The cells with a number for `curve`, by the rest of their settings as key=value texts
    ("all" where there is no other setting), in their first appearance's order."""
    groups: dict[str, list[CellResults]] = {}
    for cell in cells:
        if _is_value(cell.settings.get(curve)):
            rest = [f"{k}={v}" for k, v in cell.settings.items() if k != curve]
            name = textwrap.fill(", ".join(rest) or "all", 50, max_lines=3, placeholder="…")
            groups.setdefault(name, []).append(cell)
    return groups


def _curve_line(
    ax, cells: list[CellResults], headline: Headline, curve: str, colour: str, label: str
) -> None:
    """One combination's mean headline against the swept number, its 95% interval a band."""
    summaries = [(c.settings[curve], c.summary(headline.key)) for c in cells]
    points = sorted(((x, s) for x, s in summaries if s.mean is not None), key=lambda p: p[0])
    if not points:
        return
    xs = [x for x, _ in points]
    ax.plot(xs, [s.mean for _, s in points], color=colour, marker="o", ms=4, label=label)
    band = [(x, s.low, s.high) for x, s in points if s.low is not None and s.high is not None]
    if band:
        xs, lows, highs = zip(*band, strict=True)
        ax.fill_between(xs, lows, highs, color=colour, alpha=0.2, linewidth=0)


def _cell_curve(ax, cells: list[CellResults], headline: Headline, curve: str | None) -> None:
    if curve is None:
        ax.axis("off")
        _say(ax, "no swept number")
        return
    label = metric_label(headline.metric)
    groups = _combinations(cells, curve)
    for i, (name, group) in enumerate(groups.items()):
        _curve_line(ax, group, headline, curve, f"C{(i + 1) % 10}", name)
    xs = [c.settings[curve] for group in groups.values() for c in group]
    if xs and min(xs) > 0 and max(xs) / min(xs) >= 10:
        ax.set_xscale("log")
    if xs and len(set(xs)) <= 12:  # ticks at the swept values, as written (0.02, not 2e-2)
        from matplotlib.ticker import NullFormatter, NullLocator  # optional

        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sorted(set(xs)), [f"{x:g}" for x in sorted(set(xs))])
    ax.set_title(f"final {label} against {curve} (mean, 95% interval)")
    ax.set_xlabel(curve)
    if ax.lines:
        ax.legend(loc="best", fontsize=8, title="the other settings", title_fontsize=8)
    else:
        _say(ax, "no finished seeds")


def _cell_times(ax, cells: list[CellResults]) -> None:
    for x, cell in enumerate(cells):
        _interval(ax, x, cell.summary("seconds"), "black", "o")
    _cell_ticks(ax, cells)
    ax.set_title("time per cell (s)")
    ax.set_xlabel("cell (mean over seeds, 95% interval)")
    if ax.lines:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.05)  # from zero, the top bar's cap inside
    else:
        _say(ax, "no finished seeds")
