"""The chart of a sweep's or comparison's cells, read back from its pixels: each cell's seeds
drawn in its own column at the height of their values, the curve panel drawn only for a swept
number, and cells with no or one finished seed drawn without error."""

import math
from itertools import pairwise
from pathlib import Path

import pytest
from PIL import Image

from launch.analysis import charts
from launch.analysis.cells import CellResults
from launch.runs import Headline, Member

pytest.importorskip("scipy")  # the cells' 95% intervals
TOP1 = Headline("top1", higher_is_better=True)
C0 = (0x1F, 0x77, 0xB4)  # matplotlib's first colour: a seed's point


def cell(name: str, values: list[float], baseline: bool = False, **settings) -> CellResults:
    members = [
        Member(f"{name}-s{seed}", seed, Path(name), "finished", {"top1": v, "seconds": 60 + seed})
        for seed, v in enumerate(values)
    ]
    return CellResults(name, settings, members, baseline)


def third(png: Path, index: int) -> list[tuple[int, int, tuple[int, int, int]]]:
    """(x, y, colour) of every pixel in the index-th third of the image, left to right."""
    image = Image.open(png).convert("RGB")
    width, height = image.size
    left, right = width * index // 3, width * (index + 1) // 3
    at = image.load()
    return [(x, y, at[x, y]) for y in range(height) for x in range(left, right)]


def runs_of(xs: list[int], gap: int) -> list[list[int]]:
    """Sorted distinct xs split where two neighbours are more than gap apart."""
    groups: list[list[int]] = []
    for x in sorted(set(xs)):
        if groups and x - groups[-1][-1] <= gap:
            groups[-1].append(x)
        else:
            groups.append([x])
    return groups


def seed_columns(png: Path, cells: int, seeds: int) -> list[list[tuple[int, int]]]:
    """The scatter's pixels in the first panel, one list per cell, left to right: the points
    are told apart by the gaps between them, and each cell holds `seeds` of them."""
    points = [(x, y) for x, y, colour in third(png, 0) if colour == C0]
    blobs = runs_of([x for x, _ in points], gap=2)
    assert len(blobs) == cells * seeds, f"{len(blobs)} points drawn apart, not {cells * seeds}"
    columns = [blobs[i : i + seeds] for i in range(0, len(blobs), seeds)]
    inside = max((b[0] - a[-1] for c in columns for a, b in pairwise(c)), default=0)
    between = min((b[0][0] - a[-1][-1] for a, b in pairwise(columns)), default=math.inf)
    assert inside < between, "a cell's seeds sit closer to each other than to the next cell"
    return [
        [(x, y) for x, y in points if column[0][0] <= x <= column[-1][-1]] for column in columns
    ]


def mean_y(points: list[tuple[int, int]]) -> float:
    return sum(y for _, y in points) / len(points)


def test_seeds_drawn_in_their_cells_column_at_their_height(tmp_path: Path) -> None:
    cells = [
        cell("baseline", [0.899, 0.902, 0.905], baseline=True),
        cell("good", [0.918, 0.921, 0.924]),
        cell("bad", [0.29, 0.30, 0.31]),
    ]
    png = charts.draw_cells(cells, TOP1, tmp_path / "cells.png", "three cells")
    assert Image.open(png).size == charts.CELLS_PX
    base, good, bad = seed_columns(png, cells=3, seeds=3)
    assert all(len(points) >= 10 for points in (base, good, bad))
    # Image y grows downwards: the worse cell's points are lower, the better cell's higher.
    assert mean_y(bad) > mean_y(base) + 100 and mean_y(bad) > mean_y(good) + 100
    assert mean_y(good) < mean_y(base)


def test_one_seed_points_follow_their_values(tmp_path: Path) -> None:
    """Order of height follows order of value, whatever the order of the cells."""
    values = [0.5, 0.9, 0.1, 0.7]
    cells = [cell(f"c{i}", [v], baseline=i == 0) for i, v in enumerate(values)]
    png = charts.draw_cells(cells, TOP1, tmp_path / "cells.png", "four cells")
    heights = [mean_y(points) for points in seed_columns(png, cells=4, seeds=1)]
    by_height = sorted(range(4), key=lambda i: heights[i], reverse=True)  # lowest first
    assert by_height == sorted(range(4), key=lambda i: values[i])


def coloured(png: Path, index: int) -> int:
    """How many pixels of the index-th third are strongly coloured: not the white background,
    the black text and axes nor the grey grid."""
    return sum(max(c) - min(c) > 100 for _, _, c in third(png, index))


LRS = {0.01: [0.80, 0.81, 0.82], 0.1: [0.90, 0.91, 0.92], 1.0: [0.50, 0.55, 0.60]}


def lr_cells() -> list[CellResults]:
    return [
        cell(f"optim.lr={lr}", values, baseline=lr == 0.1, **{"optim.lr": lr})
        for lr, values in LRS.items()
    ]


def test_curve_panel_drawn_only_for_a_swept_number(tmp_path: Path) -> None:
    curve = charts.draw_cells(lr_cells(), TOP1, tmp_path / "curve.png", "lr", curve="optim.lr")
    plain = charts.draw_cells(lr_cells(), TOP1, tmp_path / "plain.png", "lr")
    assert Image.open(curve).size == Image.open(plain).size == charts.CELLS_PX
    assert coloured(curve, 1) > 500  # the line, its markers and its band
    assert coloured(plain, 1) == 0  # "no swept number", in grey


def test_curve_with_other_settings_and_lower_is_better(tmp_path: Path) -> None:
    cells = [
        cell(
            f"lr={lr},wd={wd}",
            [v + wd, v + 2 * wd],
            baseline=(lr, wd) == (0.1, 0.0),
            **{"optim.lr": lr, "optim.wd": wd},
        )  # fmt: skip
        for lr, v in ((0.1, 1.2), (0.3, 1.0), (0.5, 1.1))
        for wd in (0.0, 0.1)
    ]
    loss = Headline("eval_loss", higher_is_better=False)
    for cell_ in cells:
        for member in cell_.members:
            member.summary["eval_loss"] = member.summary.pop("top1")
    png = charts.draw_cells(cells, loss, tmp_path / "cells.png", "lr x wd", curve="optim.lr")
    assert Image.open(png).size == charts.CELLS_PX
    assert coloured(png, 1) > 500


def test_cells_without_finished_seeds_still_draw(tmp_path: Path) -> None:
    failed = CellResults("failed", {}, [Member("failed-s0", 0, tmp_path, "failed")])
    empty = CellResults("never started", {}, [])
    cells = [cell("baseline", [0.9, 0.91], baseline=True), failed, empty]
    png = charts.draw_cells(cells, TOP1, tmp_path / "cells.png", "some failed", curve=None)
    assert Image.open(png).size == charts.CELLS_PX
    (points,) = seed_columns(png, cells=1, seeds=2)  # the baseline's two seeds, no others
    nothing = charts.draw_cells([failed, empty], TOP1, tmp_path / "none.png", "none finished")
    assert Image.open(nothing).size == charts.CELLS_PX
    assert not [x for x, _, c in third(nothing, 0) if c == C0]


def test_single_cell_with_one_seed(tmp_path: Path) -> None:
    cells = [cell("only", [0.7], baseline=True, **{"optim.lr": 0.1})]
    png = charts.draw_cells(cells, TOP1, tmp_path / "cells.png", "one", curve="optim.lr")
    assert Image.open(png).size == charts.CELLS_PX
    (points,) = seed_columns(png, cells=1, seeds=1)
    assert points
