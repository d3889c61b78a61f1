"""`make report` / `python -m launch report` on run directories written by hand (config.yaml,
metrics.jsonl, summary.json, as the engine leaves them): no training here, so these run in
make test-fast; tests/launch/test_report.py reads real runs."""

import errno
import json
import os
from pathlib import Path

import pytest
import yaml

from launch import cli
from launch.analysis import charts, report


def make_run(
    parent: Path, name: str, records: list[dict], summary: dict | None, every: int = 10
) -> Path:
    folder = parent / "digits" / name
    folder.mkdir(parents=True)
    config = {"recipe": "digits", "seed": 0, "log": {"every_steps": every}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


EVAL = {"kind": "eval", "step": 3, "epoch": 0, "loss": 2.304474303981388,
        "top1": 0.10027855153203342, "top5": 0.520891364902507, "count": 359}  # fmt: skip
SUMMARY = {"eval_loss": 2.304474303981388, "top1": 0.10027855153203342,
           "top5": 0.520891364902507, "headline": "top1", "higher_is_better": True,
           "seconds": 5.258913751998989, "steps": 3, "epochs": 0, "world_size": 1}  # fmt: skip


def table(markdown: str) -> dict[str, dict[str, str]]:
    """The Markdown table as {run: {column: cell}}."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
    return {row[0]: dict(zip(head, row, strict=True)) for row in rows}


def run_report(*paths: Path, capsys) -> tuple[int, str, str]:
    code = cli.main(["report", *map(str, paths)], env={})
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def empty_texts(monkeypatch) -> dict[str, str]:
    """What each chart panel with nothing to draw would say, by the panel's title."""
    said: dict[str, str] = {}
    finish = charts._finish

    def recording(ax, title: str, empty: str) -> None:
        said[title] = empty
        finish(ax, title, empty)

    monkeypatch.setattr(charts, "_finish", recording)
    return said


# ---------------------------------------------------------------- a run shorter than a record


def test_a_run_shorter_than_log_every_steps_reports_its_evaluation(tmp_path, capsys, empty_texts):
    """3 steps with a training record every 10: no train record, but an evaluation and a
    summary, which the report shows; the empty training panels say why, not 'no records'."""
    run = make_run(tmp_path, "short", [EVAL], SUMMARY)
    code, out, err = run_report(run, capsys=capsys)
    assert code == 0, err
    md = Path(out.split()[1]).read_text()
    row = table(md)["short"]
    assert row["status"] == "finished" and row["top1"] != "–"
    assert (
        "- short: no training records, its 3 steps being fewer than log.every_steps=10; the "
        "chart shows its evaluations only" in md
    )
    for _, title in charts.TRAIN_PANELS:
        assert empty_texts[title].startswith("no training records: shorter than log.every_steps=10")


def test_a_run_with_no_record_at_all_still_says_no_records_yet(tmp_path, capsys, empty_texts):
    run = make_run(tmp_path, "starting", [], None)
    code, out, err = run_report(run, capsys=capsys)
    assert code == 0, err
    assert empty_texts["learning rate"] == empty_texts["loss"] == "no records yet"
    assert "no training records" not in Path(out.split()[1]).read_text()


# ---------------------------------------------------------------- the table's cells


def test_floats_show_4_significant_digits_ints_stay_ints_and_init_is_short(tmp_path, capsys):
    init = {
        "file": str(tmp_path / "base" / "step-00000024.pt"),
        "name": "step-00000024.pt",
        "sha256": "ab" * 32,
        "format": "checkpoint",
        "loaded": 6,
        "reinitialised": ["fc.weight", "fc.bias"],
        "unused": [],
    }
    summary = SUMMARY | {"perplexity": 12345.678, "steps": 24, "init": init}
    run = make_run(tmp_path, "tuned", [EVAL | {"step": 24}], summary)
    code, out, err = run_report(run, capsys=capsys)
    assert code == 0, err
    md = Path(out.split()[1]).read_text()
    row = table(md)["tuned"]
    assert (row["top1"], row["eval_loss"], row["top5"]) == ("0.1003", "2.304", "0.5209")
    assert (row["perplexity"], row["steps"], row["epochs"]) == ("12346", "24", "0")
    assert row["init"] == "step-00000024.pt: 6 loaded, 2 re-initialised, 0 unused"
    assert "sha256" not in md and "fc.weight" not in md
    assert "to 4 significant digits" in md


def test_number_formats():
    cases = {0.10027855153203342: "0.1003", 2.0: "2", 1.5e-06: "1.5e-06", 9999.7: "10000",
             -0.000123456: "-0.0001235", 7: "7", True: "true", float("nan"): "NaN"}  # fmt: skip
    for value, text in cases.items():
        assert report.number(value) == text, value


# ---------------------------------------------------------------- a report that cannot be written


def test_a_report_that_cannot_be_written_is_one_line_and_leaves_no_half(
    tmp_path, capsys, monkeypatch
):
    """The chart written, the table not (a full disk): one line, exit 1, no chart left."""
    run = make_run(tmp_path, "short", [EVAL], SUMMARY)

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full)
    code, out, err = run_report(run, capsys=capsys)
    assert (code, out) == (1, "")
    assert err == (
        f"launch: cannot write the report in {tmp_path / 'digits'} (No space left on device); "
        "make it writable\n"
    )
    assert sorted(os.listdir(tmp_path / "digits")) == ["short"]
