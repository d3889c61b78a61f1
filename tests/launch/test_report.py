"""`make report` / `python -m launch report` and the sweep's chart, on real run directories
left by short digits runs: a 2-seed sweep, a run stopped and resumed, a run on 2 processes."""

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from launch import cli, runs
from launch.analysis import charts, report
from tests import helpers

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
# An epoch is 22 steps: evaluations at step 22 and at the end, a train record every 4 steps.
SHORT = ["train.max_steps=24", "log.every_steps=4"]
SPAWN_2 = [sys.executable, "-m", "engine.train", "--spawn", "2"]
STAMP = ".venv/.installed-lock"  # the Makefile's venv stamp; -o: never rebuild it from here


def clean_env(**extra: str) -> dict[str, str]:
    return helpers.launch_env(helpers.engine_env(), **extra)


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    return helpers.launch(*args, timeout=600, **env)


@pytest.fixture(scope="module")
def root(tmp_path_factory, train_here) -> Path:
    """The run directories every test here reads (made once: each run costs seconds). The
    single-process runs whose process is not the subject train in the test's process."""
    root = tmp_path_factory.mktemp("runs")
    done = launch("sweep", "--gpus", "0", "--seeds", "2", "--", *helpers.QUIET,
                  f"run.root={root}", "run.name=sw", *SHORT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    train_here(root, "resumed", *SHORT, "optim.lr=0.2", "train.stop_at_step=8")
    assert "stopped at step 8" in (helpers.run_dir(root, "resumed") / "train.log").read_text()
    # A copy of the run as it stood then: no evaluation yet and no summary.json.
    shutil.copytree(helpers.run_dir(root, "resumed"), helpers.run_dir(root, "stopped"))
    second = helpers.run_engine(root, "resumed", *SHORT, "optim.lr=0.2")
    assert "resuming from" in second.stderr
    helpers.run_engine(root, "two", *SHORT, prefix=SPAWN_2)
    # Stopped after its first evaluation (step 22), before the end: no summary.json.
    train_here(root, "stopped-late", *SHORT, "train.stop_at_step=23")
    late = (helpers.run_dir(root, "stopped-late") / "train.log").read_text()
    assert "stopped at step 23" in late
    return root


def summary(root: Path, name: str) -> dict:
    return json.loads((helpers.run_dir(root, name) / "summary.json").read_text())


def table(markdown: str, which: int = 0) -> dict[str, dict[str, str]]:
    """The Markdown's which-th table as {run: {column: cell}}."""
    blocks, previous = [], False
    for line in markdown.splitlines():
        is_row = line.startswith("| ")
        if is_row and not previous:
            blocks.append([])
        if is_row:
            blocks[-1].append(line)
        previous = is_row or line.startswith("|---")
    lines = blocks[which]
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
    return {row[0]: dict(zip(head, row, strict=True)) for row in rows}


def image_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        image.load()  # decodes every pixel: a truncated file fails here
        assert image.format == "PNG"
        return image.size


def run_report(*args: str, capsys) -> tuple[int, str, str]:
    code = cli.main(["report", *args], env={})
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- the report of several runs


def test_make_report_of_a_sweep_seed_a_resumed_run_and_a_2_process_run(root):
    names = ["sw-seed0", "resumed", "two"]
    paths = " ".join(str(helpers.run_dir(root, n)) for n in names)
    make = ["make", "-s", "-o", STAMP, "report", f"RUNS={paths}"]
    done = subprocess.run(make, cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    png, md = map(Path, done.stdout.split())
    assert png.parent == md.parent == root / "digits"  # beside the runs
    assert png.name == "report-resumed+sw-seed0+two.png" and md.suffix == ".md"
    assert image_size(png) == charts.RUNS_PX
    rows = table(md.read_text())
    assert list(rows) == names
    for name in names:
        for key, value in summary(root, name).items():
            if key not in report.OWN_COLUMNS:
                assert rows[name][key] == report.value_text(value), (name, key)
        env = json.loads((helpers.run_dir(root, name) / "env.json").read_text())
        assert rows[name]["git"].startswith(env["git_sha"][:12])
        assert rows[name]["status"] == "finished"
    assert rows["two"]["world size"] == "2" and rows["resumed"]["world size"] == "1"
    assert rows["resumed"]["differs"] == "optim.lr=0.2 world_size=1"
    assert rows["two"]["differs"] == "optim.lr=0.1 world_size=2"
    assert "run.name" not in md.read_text() and "run.root" not in md.read_text()
    assert f"]({png.name})" in md.read_text()  # the Markdown shows the chart


def test_the_report_says_where_each_runs_training_time_went(root):
    """The second table: each share's mean over a run's windows after the first."""
    names = ["sw-seed0", "two"]
    found = report.read_runs([str(helpers.run_dir(root, n)) for n in names])
    rows = table(report.markdown(found, None, "top1"), which=1)
    assert list(rows) == names
    for name in names:
        windows = helpers.records(root, name, "train")[1:]
        for key, title in report.TIME_SHARES[:5]:  # the training thread's, in every record
            mean = sum(r[key] for r in windows) / len(windows)
            assert rows[name][title] == f"{100 * mean:.1f}%", (name, key)
        assert "decode" not in rows[name]  # digits finishes nothing on the device


def test_the_legend_names_each_run_by_what_differs(root):
    found = report.read_runs([str(helpers.run_dir(root, n)) for n in ("sw-seed1", "resumed")])
    assert report.labels(found) == ["sw-seed1: optim.lr=0.1 seed=1", "resumed: optim.lr=0.2 seed=0"]


def test_the_resumed_run_reads_each_step_once_with_the_latest_record(root, tmp_path):
    run = runs.read_run(str(helpers.run_dir(root, "resumed")))
    steps = [r["step"] for r in run.metrics.train]
    assert steps == list(range(4, 25, 4))  # both processes' records, none lost
    # Records written twice for the steps after a checkpoint (a resumed run may leave them):
    # the later one counts.
    copy = shutil.copytree(helpers.run_dir(root, "resumed"), tmp_path / "resumed")
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    again = [json.loads(line) | {"loss": 100.0 + i} for i, line in enumerate(lines[-3:])]
    with (copy / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in again)
    metrics = runs.read_metrics(copy / "metrics.jsonl")
    for kind in ("train", "eval"):
        steps = [r["step"] for r in getattr(metrics, kind)]
        assert steps == sorted(set(steps)) and steps == sorted(
            {r["step"] for r in map(json.loads, lines) if r["kind"] == kind}
        )
    by_step = {(r["kind"], r["step"]): r for r in metrics.train + metrics.eval}
    for record in again:
        assert by_step[record["kind"], record["step"]]["loss"] == record["loss"]


def test_a_stopped_run_without_evaluation_is_reported_as_far_as_it_went(root, capsys):
    paths = [str(helpers.run_dir(root, name)) for name in ("stopped", "sw-seed1")]
    code, out, err = run_report(*paths, capsys=capsys)
    assert code == 0, err
    png, md = map(Path, out.split())
    assert image_size(png) == charts.RUNS_PX
    rows = table(md.read_text())
    assert rows["stopped"]["status"] == "no summary.json yet, at step 8 (running or stopped)"
    assert rows["stopped"]["top1"] == "–" and rows["stopped"]["world size"] == "1"
    assert rows["sw-seed1"]["top1"] == report.number(summary(root, "sw-seed1")["top1"])
    assert rows["stopped"]["differs"] == "optim.lr=0.2 seed=0"


def test_a_stopped_run_shows_its_last_evaluation_marked_unfinished(root, capsys):
    """train.stop_at_step (as a preemption) leaves evaluations but no summary.json: the report
    shows the last evaluation's metrics, its headline marked with the step, not '–'."""
    (last,) = helpers.records(root, "stopped-late", "eval")
    assert last["step"] == 22
    assert not (helpers.run_dir(root, "stopped-late") / "summary.json").exists()
    for names in (["stopped-late", "sw-seed0"], ["stopped-late"]):  # alone: no summary at all
        code, out, err = run_report(*(str(helpers.run_dir(root, n)) for n in names), capsys=capsys)
        assert code == 0, err
        md = Path(out.split()[1]).read_text()
        rows = table(md)
        stopped = rows["stopped-late"]
        assert stopped["top1"] == f"{report.number(last['top1'])} (at step 22, unfinished)"
        assert stopped["top5"] == report.number(last["top5"])
        assert stopped["eval_loss"] == report.number(last["loss"])
        assert stopped["status"] == (
            "no summary.json yet, at step 23 (running or stopped); "
            "metrics of its last evaluation, at step 22"
        )
        assert "shows the metrics of its last evaluation in metrics.jsonl, not final ones" in md
    assert rows["stopped-late"]["time"] == "n/a"


# ---------------------------------------------------------------- paths that are not runs


def test_a_bad_path_and_an_empty_directory_are_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "nope"): "no such directory",
        str(tmp_path / "empty"): "is an empty directory, not a run",
        str(ROOT / "recipes" / "digits"): "is not a run directory (it has no metrics.jsonl)",
    }
    for path, message in cases.items():
        code, out, err = run_report(path, capsys=capsys)
        assert code == 2 and out == "", err
        assert err.count("\n") == 1 and err.startswith(f"launch: {path}") and message in err
    assert os.listdir(tmp_path) == ["empty"]  # nothing written


def test_a_folder_of_runs_says_to_name_the_runs(root, capsys):
    code, _, err = run_report(str(root / "digits"), capsys=capsys)
    assert code == 2 and err.count("\n") == 1
    assert "holds runs, not a run's files; name the runs: RUNS=" in err


def test_a_torn_last_metrics_line_is_skipped_and_said(root, tmp_path, capsys):
    copy = shutil.copytree(helpers.run_dir(root, "sw-seed1"), tmp_path / "torn")
    data = (copy / "metrics.jsonl").read_bytes()
    whole, last = data[:-1].rsplit(b"\n", 1)  # a killed writer leaves part of its last line
    (copy / "metrics.jsonl").write_bytes(whole + b"\n" + last[: len(last) // 2])
    number = whole.count(b"\n") + 2
    code, out, err = run_report(str(copy), capsys=capsys)
    assert code == 0
    said = f"{copy / 'metrics.jsonl'}: line {number} skipped, torn (written only in part)"
    assert err == f"launch: warning: {said}\n"
    png, md = map(Path, out.split())
    assert f"- {said}" in md.read_text() and image_size(png) == charts.RUNS_PX
    kept = runs.read_metrics(copy / "metrics.jsonl")
    assert len(kept.train) + len(kept.eval) == number - 1


# ---------------------------------------------------------------- the seed sweep's report


def test_the_seed_sweep_report_embeds_its_chart_and_its_statistics_match_the_seeds(root):
    folder = root / "digits" / "sw-sweep"
    text = (folder / "report.md").read_text()
    data = json.loads((folder / "report.json").read_text())
    assert "](chart.png)" in text and data["chart"] == "chart.png"
    assert image_size(folder / "chart.png") == charts.CELLS_PX
    (cell,) = data["cells"]
    assert [m["run"] for m in cell["members"]] == [f"sw-seed{i}" for i in range(2)]
    values = [summary(root, f"sw-seed{i}")["top1"] for i in range(2)]
    top1 = cell["top1"]
    assert top1["n"] == 2 and top1["mean"] == pytest.approx(statistics.fmean(values))
    assert top1["std"] == pytest.approx(statistics.stdev(values))
    assert top1["low"] < top1["mean"] < top1["high"]
    row = next(line for line in text.splitlines() if line.startswith("| 1 | sw (baseline) |"))
    mean, std = 100 * top1["mean"], 100 * top1["std"]  # in percent, as the training log says
    assert f"| 2 finished | {mean:.2f}% | {std:.2f}% |" in row
    low, high = max(top1["low"], 0), min(top1["high"], 1)  # an accuracy stays in [0, 100] %
    assert f"| [{100 * low:.2f}%, {100 * high:.2f}%] |" in row


def test_a_language_model_is_reported_by_its_eval_loss(tmp_path, capsys, train_here):
    """The headline comes from summary.json (the recipe's task): eval_loss leads the table."""
    train_here(tmp_path, "a", "train.max_steps=4", "optim.lr=0.002", recipe="gpt")
    capsys.readouterr()  # the run's own lines
    folder = str(tmp_path / "gpt" / "a")
    assert runs.read_run(folder).headline.metric == "loss"
    code, _, err = run_report(folder, capsys=capsys)
    assert code == 0, err
    lines = (tmp_path / "gpt" / "report-a.md").read_text().splitlines()
    columns = [c.strip() for c in next(x for x in lines if x.startswith("| run |")).split("|")]
    assert columns[1:4] == ["run", "status", "eval_loss"]
    assert "perplexity" in columns and "headline" not in columns
