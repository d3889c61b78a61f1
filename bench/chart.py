"""The report's chart: one horizontal bar per result, its ratio against the baseline measured
in the same run (higher is better, on a logarithmic axis), with its target drawn as a black
tick across the bar.
Drawn with matplotlib's Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import StrMethodFormatter

DPI = 100
WIDTH_PX = 1200
ROW_PX = 50
FRAME_PX = 150  # title, axis and legend


def size_px(rows: int) -> tuple[int, int]:
    """(width, height) in pixels of the chart of `rows` results."""
    return WIDTH_PX, FRAME_PX + ROW_PX * max(rows, 1)


def colour(row: dict) -> str:
    if row["target"] is None:
        return "tab:gray"
    return "tab:green" if row["ratio"] >= row["target"] else "tab:orange"


def scale(ax, rows: list[dict]) -> None:
    """Logarithmic: ratios are factors, so 0.5 and 2 sit equally far from parity, and one
    large ratio does not squeeze the targets near 1 into a corner."""
    values = [r["ratio"] for r in rows] + [r["target"] for r in rows if r["target"]] + [1.0]
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(values) / 1.5, max(values) * 1.6)
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))


def draw(rows: list[dict], path: Path, title: str) -> Path:
    width, height = size_px(len(rows))
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    fig.subplots_adjust(left=0.42, right=0.96, top=1 - 70 / height, bottom=60 / height)
    ys = range(len(rows))
    ax.barh(ys, [r["ratio"] for r in rows], color=[colour(r) for r in rows], height=0.6)
    for y, row in zip(ys, rows, strict=True):
        right = max(row["ratio"], row["target"] or 0) * 1.02  # clear of the target tick
        ax.text(right, y, f" {row['ratio']:.2f}", va="center", fontsize=9)
        if row["target"] is not None:
            ax.vlines(row["target"], y - 0.4, y + 0.4, colors="black", linewidth=3)
    ax.plot([], [], color="black", linewidth=3, label="target")  # one legend entry for all
    ax.axvline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_yticks(list(ys), [r["name"] for r in rows], fontsize=9)
    ax.invert_yaxis()  # first result on top, as in the printed table
    scale(ax, rows)
    ax.set_xlabel(
        "ratio against the baseline measured in the same run (higher is better, log scale)"
    )
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=DPI)
    return path
