"""`python -m bench` runs every benchmark and writes its report.

The slow test runs the whole thing at its smallest sizes (the hidden --smoke: far too small
for the figures to mean anything, and no timing is asserted) and checks what the report
promises: every named result with a finite positive ratio, the run's metadata, a chart of the
promised size. The fast tests check the table, the chart and a bad request on their own."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from bench import chart
from bench.__main__ import main, parse_args, status, table

ROOT = Path(__file__).resolve().parents[2]
SMOKE_NAMES = {
    "overhead: digits": "overhead",
    "overhead: resnet18 64px synthetic": "overhead",
    "host time per step: Linear, batch 512": "host_step",
    "end to end: imagenet resnet18 64px JPEGs": "end_to_end",
    "start-up: make train digits": "startup",
}
KEYS = {"name", "measured", "baseline", "ratio", "target", "unit", "note", "benchmark"}


def row(name: str, ratio: float, target: float | None) -> dict:
    return {
        "name": name,
        "measured": 1.0,
        "baseline": 2.0,
        "ratio": ratio,
        "target": target,
        "unit": "img/s",
        "note": f"note of {name}",
    }


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("bench") / "out"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, out


@pytest.mark.slow
def test_every_named_result_has_a_finite_positive_ratio(smoke):
    done, out = smoke
    report = json.loads((out / "results.json").read_text())
    assert report["errors"] == []
    by_name = {r["name"]: r for r in report["results"]}
    assert {name: by_name[name]["benchmark"] for name in SMOKE_NAMES} == SMOKE_NAMES
    if importlib.util.find_spec("bench.decode"):
        assert any(r["benchmark"] == "decode" for r in report["results"])
    for r in report["results"]:
        assert KEYS <= r.keys(), r["name"]
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        assert r["target"] is None or r["target"] > 0, r
    assert 0 <= by_name["end to end: imagenet resnet18 64px JPEGs"]["data_wait"] <= 1
    assert by_name["start-up: make train digits"]["baseline"] == 10.0
    for name in SMOKE_NAMES:  # the printed table names each with its status
        assert any(
            line.startswith(name) and line.rstrip().endswith(("PASS", "below"))
            for line in done.stdout.splitlines()
        ), name
    assert f"results: {out / 'results.json'}" in done.stdout


@pytest.mark.slow
def test_report_records_the_run(smoke):
    _, out = smoke
    report = json.loads((out / "results.json").read_text())
    assert report["smoke"] is True and report["quick"] is False
    assert report["cpu_count"] >= 1 and report["threads"] >= 1 and report["host"]
    assert report["date"][:4].isdigit() and "T" in report["date"]
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    for name in ("torch", "torchvision", "matplotlib"):
        assert report["versions"][name] == importlib.metadata.version(name)
    assert len(report["git_sha"]) == 40
    assert set(report["seconds_each"]) >= {"overhead", "host_step", "end_to_end", "startup"}


@pytest.mark.slow
def test_chart_is_a_png_of_the_promised_size(smoke):
    _, out = smoke
    rows = json.loads((out / "results.json").read_text())["results"]
    with Image.open(out / "chart.png") as image:
        assert image.format == "PNG"
        assert image.size == chart.size_px(len(rows))


def test_chart_draws_rows_without_a_target(tmp_path):
    rows = [row("a", 0.5, 0.97), row("b", 12.0, None), row("c", 1.0, 1.0)]
    path = chart.draw(rows, tmp_path / "chart.png", "title")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == chart.size_px(3)


def test_status_and_table():
    rows = [row("low", 0.96, 0.97), row("on target", 0.97, 0.97), row("info", 3.0, None)]
    assert [status(r) for r in rows] == ["below", "PASS", "-"]
    lines = table(rows).splitlines()
    assert lines[0].split()[:4] == ["benchmark", "measured", "baseline", "unit"]
    assert lines[1].startswith("low") and lines[1].endswith("below")
    assert lines[2].startswith("on target") and ">=0.97" in lines[2]
    assert "- info: note of info" in lines


def test_unknown_option_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--fast"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --fast" in capsys.readouterr().err


def test_an_output_path_under_a_file_fails_before_measuring(tmp_path, capsys):
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    assert main(["--out", str(taken / "run")]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: cannot write the report to {taken / 'run'}: ")
    assert err.count("\n") == 1
    assert "running" not in out  # no benchmark started
