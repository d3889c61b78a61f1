"""`make publish` / `python -m launch publish` on a real digits run: read back through
TensorBoard's EventAccumulator and MLflow's client (a sqlite tracking URI), every scalar of
metrics.jsonl at its step; publishing again adds nothing; a changed run replaces its
publication. And log.tensorboard: the same scalars written live by the engine."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import cli, runs
from launch.analysis import publish
from tests import helpers

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STAMP = ".venv/.installed-lock"  # the Makefile's venv stamp; -o: never rebuild it from here
# An epoch is 22 steps: evaluations at step 22 and at the end, a train record every 4 steps.
SHORT = ["train.max_steps=24", "log.every_steps=4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, train_here) -> Path:
    """One short digits run, stopped at step 8 and resumed, written live to TensorBoard too
    (log.tensorboard), and its report (a chart and a Markdown file beside it)."""
    root = tmp_path_factory.mktemp("runs")
    train_here(root, "pub", *SHORT, "log.tensorboard=true", "train.stop_at_step=8")
    train_here(root, "pub", *SHORT, "log.tensorboard=true")
    path = helpers.run_dir(root, "pub")
    assert cli.main(["report", str(path)], env={}) == 0
    return path


def expected(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every numeric field of every train and eval record, by tag: [(step, value)]."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in (path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] not in ("train", "eval"):
            continue
        for key, value in record.items():
            if key not in ("kind", "step") and type(value) in (int, float):
                series.setdefault(f"{record['kind']}/{key}", []).append((record["step"], value))
    return series


def finals(summary: dict) -> set[str]:
    return {f"final/{k}" for k, v in summary.items() if type(v) in (int, float)}


def published(*args: str, capsys, env: dict | None = None) -> tuple[int, str, str]:
    code = cli.main(["publish", *args], env=env or {})
    out, err = capsys.readouterr()
    return code, out, err


def add_a_report(path: Path) -> Path:
    """A report naming the run appears beside it: the publication changes."""
    extra = path.parent / f"report-{path.name}+other.md"
    extra.write_text("# another report\n")
    return extra


# ---------------------------------------------------------------- TensorBoard


def read_tensorboard(folder: Path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    keep_all = {ea.TENSORS: 0, ea.IMAGES: 0, ea.SCALARS: 0}
    acc = ea.EventAccumulator(str(folder), size_guidance=keep_all)
    acc.Reload()
    return acc


def as_tensorboard_shows(folder: Path):
    """The accumulator TensorBoard's server reads a run with: it also drops, at a restart's
    mark, the tensor-format scalars written after it (the one above keeps those)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea

    acc = pea.EventAccumulator(str(folder), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    return acc


def tensorboard_series(acc) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.util import tensor_util

    tags = [t for t in acc.Tags()["tensors"] if t.startswith(("train/", "eval/", "final/"))]
    return {
        tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
        for tag in tags
    }


def test_tensorboard_reads_back_every_scalar_at_its_step_and_again_adds_nothing(
    run, tmp_path, capsys
):
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    code, out, err = published("--to", f"tensorboard:{tmp_path}", str(run), capsys=capsys)
    assert code == 0, err
    folder = tmp_path / run.name
    acc = read_tensorboard(folder)
    got = tensorboard_series(acc)
    want = expected(run)
    assert {"train/loss", "train/lr", "eval/top1", "eval/loss"} <= set(want)
    for tag, points in want.items():  # float32 in TensorBoard
        assert got[tag] == [(s, float(np.float32(v))) for s, v in points], tag
    summary = json.loads((run / "summary.json").read_text())
    assert got["final/top1"] == [(24, float(np.float32(summary["top1"])))]
    assert set(got) == set(want) | finals(summary)
    # The config as hparams, the chart as an image, the files as text.
    start = acc.PluginTagToContent("hparams")[metadata.SESSION_START_INFO_TAG]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    config = publish.hparams(runs.read_run(str(run)))
    assert hparams["optim.lr"].number_value == config["optim.lr"]
    assert hparams["optim.name"].string_value == config["optim.name"]
    (chart,) = acc.Images(f"charts/report-{run.name}.png")
    assert (chart.width, chart.height) == (1500, 1000)
    assert {f"files/{n}" for n in ("config.yaml", "summary.json", f"report-{run.name}.md")} <= set(
        acc.Tags()["tensors"]
    )

    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    code, out, err = published("--to", f"tensorboard:{tmp_path}", str(run), capsys=capsys)
    assert code == 0 and f"up to date in TensorBoard folder {folder}, nothing written" in out, (
        out,
        err,
    )
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before

    # A changed run: its folder replaced whole, each point still once.
    extra = add_a_report(run)
    try:
        code, out, err = published("--to", f"tensorboard:{tmp_path}", str(run), capsys=capsys)
    finally:
        extra.unlink()
    assert code == 0 and f"published to TensorBoard folder {folder}" in out, err
    assert len([p for p in folder.iterdir() if p.name.startswith("events.")]) == 1
    assert tensorboard_series(read_tensorboard(folder)) == got
    assert [p.name for p in tmp_path.iterdir()] == [run.name]  # nothing left aside


def test_make_publish_writes_tensorboard_beside_the_runs_and_refuses_a_foreign_folder(run):
    env = helpers.launch_env(helpers.engine_env())
    make = ["make", "-s", "-o", STAMP, "publish", f"RUNS={run}", "TO=tensorboard"]
    done = subprocess.run(make, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    folder = run.parent / "tensorboard" / run.name
    assert json.loads((folder / "publish.json").read_text())["run_dir"] == str(run.resolve())
    assert f"tensorboard --logdir {folder.parent}" in done.stdout
    # Another run's publication, or a folder publish did not write, is never replaced.
    mark = folder / "publish.json"
    mark.write_text(json.dumps({"run_dir": "/elsewhere", "fingerprint": "x"}))
    again = subprocess.run(make, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "holds the publication of another run" in again.stderr
    said = [line for line in again.stderr.splitlines() if not line.startswith("make: ")]
    assert len(said) == 1 and said[0].startswith("launch: "), again.stderr


def test_log_tensorboard_writes_every_scalar_live_once_across_a_resume(run):
    """The engine's own events (log.tensorboard=true), from both starts of the run: each
    record's numbers at its step, each step once."""
    got = tensorboard_series(as_tensorboard_shows(run / "tensorboard"))
    want = expected(run)
    assert [s for s, _ in want["train/loss"]] == [4, 8, 12, 16, 20, 24]
    assert len(list((run / "tensorboard").glob("events.*"))) == 2  # one file per start
    assert got == {
        tag: [(s, float(np.float32(v))) for s, v in points] for tag, points in want.items()
    }


def test_log_tensorboard_after_a_crash_shows_the_steps_trained_again_once(tmp_path):
    """Records after the checkpoint (step 8) were written, then the run died: the resumed
    start's mark makes TensorBoard drop them, and its own records count."""
    from engine.tracking import LiveTensorBoard

    first = LiveTensorBoard(tmp_path, resume_step=0)
    for step in (4, 8, 12):
        first.write({"kind": "train", "step": step, "loss": float(step)})
    first.close()
    second = LiveTensorBoard(tmp_path, resume_step=8)
    for step in (12, 16):
        second.write({"kind": "train", "step": step, "loss": step + 0.5})
    second.write({"kind": "world_size", "step": 16, "from": 1, "to": 2})  # an event: not shown
    second.close()
    got = tensorboard_series(as_tensorboard_shows(tmp_path / "tensorboard"))
    assert got == {"train/loss": [(4, 4.0), (8, 8.0), (12, 12.5), (16, 16.5)]}


def test_log_tensorboard_without_the_package_is_one_line_in_preflight(monkeypatch):
    from engine.config import ConfigError, LogConfig
    from engine.tracking import tensorboard_check

    tensorboard_check(LogConfig(tensorboard=True))  # installed: nothing said
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    tensorboard_check(LogConfig())  # off: never looked for
    with pytest.raises(ConfigError, match=r"pip install tensorboard .*log.tensorboard=false"):
        tensorboard_check(LogConfig(tensorboard=True))


# ---------------------------------------------------------------- MLflow


def test_mlflow_sqlite_reads_back_every_scalar_at_its_step_and_again_adds_nothing(
    run, tmp_path, capsys
):
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code, out, err = published("--to", f"mlflow:{uri}", str(run), capsys=capsys)
    assert code == 0, err
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("digits")  # the recipe
    (found,) = client.search_runs([experiment.experiment_id])
    run_id = found.info.run_id
    assert found.info.status == "FINISHED" and found.info.run_name == run.name
    want = expected(run)
    for tag, points in want.items():
        history = client.get_metric_history(run_id, tag)
        assert sorted((m.step, m.value) for m in history) == points, tag
    summary = json.loads((run / "summary.json").read_text())
    assert found.data.metrics["final/top1"] == summary["top1"]
    assert set(found.data.metrics) == set(want) | finals(summary)
    assert found.data.params["optim.name"] == "sgd"
    assert float(found.data.params["optim.lr"]) == 0.1
    assert found.data.tags[publish.TAG_DIR] == str(run.resolve())
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "summary.json", "env.json", "reports"} <= names
    reports = {a.path for a in client.list_artifacts(run_id, "reports")}
    assert reports == {f"reports/report-{run.name}.png", f"reports/report-{run.name}.md"}

    code, out, err = published("--to", f"mlflow:{uri}", str(run), capsys=capsys)
    assert code == 0 and f"up to date in MLflow run {run_id}" in out, (out, err)
    every = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
    assert [r.info.run_id for r in every] == [run_id]  # nothing added, nothing deleted
    assert len(client.get_metric_history(run_id, "train/loss")) == len(want["train/loss"])

    # A changed run replaces its MLflow run: one active run, each point once.
    extra = add_a_report(run)
    try:
        code, out, err = published("--to", f"mlflow:{uri}", str(run), capsys=capsys)
    finally:
        extra.unlink()
    assert code == 0 and "published as MLflow run" in out, err
    (now,) = client.search_runs([experiment.experiment_id])
    assert now.info.run_id != run_id
    history = client.get_metric_history(now.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == want["train/loss"]


def test_mlflow_by_default_writes_a_sqlite_file_beside_the_runs_without_torch(run, tmp_path):
    """A separate process, as make runs it: launch imports no torch, MLflow's neither."""
    copy = tmp_path / "digits" / run.name
    copy.parent.mkdir()
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)
    script = (
        "import sys; from launch import cli; code = cli.main(['publish', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)"
    )
    env = helpers.launch_env(helpers.engine_env(), TO="mlflow")
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([sys.executable, "-c", script, str(copy)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # MLflow's set-up of a new store says nothing
    db = tmp_path / "digits" / "mlflow.db"
    assert f"mlflow ui --backend-store-uri sqlite:///{db}" in done.stdout
    assert (tmp_path / "digits" / "mlartifacts" / "digits").is_dir()


# ---------------------------------------------------------------- one-line errors


def test_a_missing_package_is_one_line_naming_it_exit_1(run, tmp_path, monkeypatch, capsys):
    for name in ("mlflow.tracking", "mlflow.exceptions"):
        monkeypatch.setitem(sys.modules, name, None)
    code, out, err = published("--to", f"mlflow:sqlite:///{tmp_path}/m.db", str(run),
                               capsys=capsys)  # fmt: skip
    assert code == 1 and len(err.splitlines()) == 1, err
    assert "pip install mlflow-skinny sqlalchemy alembic" in err
    for name in ("tensorboard.compat.proto", "tensorboard.summary.writer.event_file_writer"):
        monkeypatch.setitem(sys.modules, name, None)
    code, out, err = published("--to", f"tensorboard:{tmp_path}/tb", str(run), capsys=capsys)
    assert code == 1 and len(err.splitlines()) == 1 and "pip install tensorboard" in err, err
    assert list((tmp_path / "tb").iterdir()) == []  # nothing half written


def test_bad_paths_and_targets_are_one_line_exit_2(run, tmp_path, capsys):
    cases = [
        (["--to", "tensorboard", str(tmp_path / "nope")], "no such directory"),
        (["--to", "tensorboard", str(run.parent)], "holds runs, not a run's files"),
        (["--to", "wandb", str(run)], "publish to tensorboard or mlflow"),
        ([str(run)], "publish needs TO=tensorboard[:DIR] or TO=mlflow[:URI]"),
        (["--to", "mlflow", str(run), str(run)], "is given twice"),
    ]
    for args, said in cases:
        code, out, err = published(*args, capsys=capsys)
        assert code == 2 and out == "", (args, out, err)
        assert len(err.splitlines()) == 1 and said in err, (args, err)
    code, out, err = published("--to", "mlflow", "--dry-run", str(run), capsys=capsys)
    assert code == 0 and f"sqlite:///{run.parent.resolve() / 'mlflow.db'}" in out, err
    assert not (run.parent / "mlflow.db").exists()
