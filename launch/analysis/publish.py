"""`python -m launch publish RUN_DIR...` (`make publish RUNS=... TO=tensorboard|mlflow`): run
directories published to the viewers people already run, through those libraries' own writers.

What a run publishes, to either viewer:
- every numeric field of every train and eval record of metrics.jsonl at its step, tagged
  `<kind>/<field>` as W&B's are (train/loss, train/lr, eval/top1, eval/loss, ...);
- summary.json's numeric values as `final/<key>` at the run's last step;
- its config, flattened (optim.lr, ...), as TensorBoard hparams or MLflow params;
- config.yaml, summary.json, env.json and the reports and charts that `make report` and
  `make compare` wrote beside it naming it (report-<names>.png/.md, compare-...), as MLflow
  artifacts, or in TensorBoard as text (the files) and images (the charts).

TO=tensorboard[:DIR]: one folder per run, DIR/<run name> (default: tensorboard/ beside the run,
runs/<recipe>/tensorboard/<run name>), written by tensorboard's event file writer: point
`tensorboard --logdir DIR` at it. TO=mlflow[:URI]: one MLflow run per run directory in the
experiment named after its recipe, through MLflow's client, at any tracking URI (default:
MLFLOW_TRACKING_URI, else a sqlite file beside the run, runs/<recipe>/mlflow.db, with its
artifacts in mlartifacts/ beside it).

Publishing twice adds nothing. Each publication records a fingerprint of what it was made from
(the run's files and this module's format): a TensorBoard folder in its publish.json, an MLflow
run in a tag, set last, beside a tag naming the run directory. The same fingerprint again is
skipped; another (the run went on, a report was added) replaces the old publication: the
TensorBoard folder is written aside and swapped in whole, the MLflow run is deleted and
written again. A missing package is one line naming what to install (exit 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch import runs
from launch.analysis import report
from launch.errors import UserError, printable
from launch.runs import RunRecord

KINDS = ("train", "eval")  # the records published; events (world_size, code) are not metrics
NOT_SCALARS = ("kind", "step")
FORMAT = 1  # what a publication holds: a new format publishes every run again
RUN_FILES = ("metrics.jsonl", "config.yaml", "summary.json", "env.json")
ARTIFACTS = ("config.yaml", "summary.json", "env.json")
MARKER = "publish.json"  # in a TensorBoard run folder: what it was published from
TAG_KEY = "recipes.run_key"  # MLflow: the run directory's identity (a hash of its path)
TAG_DIR = "recipes.run_dir"
TAG_FINGERPRINT = "recipes.fingerprint"  # set last: a run without it was cut short
MLFLOW_BATCH = 1000  # metrics per log_batch (MLflow's limit)
MLFLOW_PARAMS = 100  # params per log_batch (MLflow's limit)
MLFLOW_PARAM_CHARS = 6000  # a param value's longest (MLflow's limit)
TO_HELP = "TO=tensorboard[:DIR] or TO=mlflow[:URI]"
VENV_HINT = "or use the project's venv (make venv installs requirements.lock)"


@dataclass(frozen=True)
class Target:
    kind: str  # tensorboard | mlflow
    where: str  # a folder, a tracking URI, or "" for the default beside each run


def parse_target(args: argparse.Namespace, env: Mapping[str, str]) -> Target:
    text = args.to or env.get("TO", "")
    if not text:
        raise UserError(
            f"publish needs {TO_HELP}, e.g. make publish RUNS=runs/digits/NAME TO=tensorboard"
        )
    kind, _, where = text.partition(":")
    if kind not in ("tensorboard", "mlflow"):
        raise UserError(f"TO={text}: publish to tensorboard or mlflow ({TO_HELP})")
    return Target(kind, where)


# ---------------------------------------------------------------- what a run publishes


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def scalars(run: RunRecord) -> Iterator[tuple[str, int, float]]:
    """(tag, step, value) for every numeric field of every train and eval record."""
    for kind in KINDS:
        for record in getattr(run.metrics, kind):
            for key, value in record.items():
                if key not in NOT_SCALARS and is_number(value):
                    yield f"{kind}/{key}", record["step"], float(value)


def finals(run: RunRecord) -> dict[str, float]:
    """summary.json's numeric values (none before the run finishes)."""
    return {f"final/{k}": float(v) for k, v in (run.summary or {}).items() if is_number(v)}


def hparams(run: RunRecord) -> dict[str, bool | float | str]:
    """The flattened config as values both viewers take: numbers and booleans as they are,
    the rest as an override would write them (sgd, null, [0.9, 0.999])."""
    return {
        key: value if isinstance(value, bool) or is_number(value) else runs.value_text(value)
        for key, value in sorted(run.config.items())
    }


def reports(run: RunRecord) -> list[Path]:
    """The reports and charts make report and make compare left in the run's parent folder
    that name this run (report-a+b.png names a and b)."""
    found = []
    for path in sorted(run.path.resolve().parent.glob("*-*")):
        head, _, names = path.stem.partition("-")
        named = run.path.resolve().name in names.split("+")
        if head in ("report", "compare") and named and path.is_file():
            found.append(path)
    return found


def artifacts(run: RunRecord) -> list[Path]:
    return [run.path / n for n in ARTIFACTS if (run.path / n).is_file()] + reports(run)


def fingerprint(run: RunRecord) -> str:
    """A hash of everything a publication is made from: a changed file publishes again."""
    digest = hashlib.sha256(f"format {FORMAT}\n".encode())
    for path in [*(run.path / n for n in RUN_FILES), *reports(run)]:
        if path.is_file():
            digest.update(f"{path.name} {path.stat().st_size}\n".encode(errors="replace"))
            digest.update(path.read_bytes())
    return digest.hexdigest()


def run_key(run: RunRecord) -> str:
    """The run directory's identity: a hash of its absolute path (a tag value any tracking
    store can search for, whatever characters the path holds)."""
    return hashlib.sha256(os.fsencode(run.path.resolve())).hexdigest()[:32]


def missing(package: str, install: str) -> UserError:
    return UserError(
        f"publishing needs {package}, which is not installed here: pip install {install}, "
        f"{VENV_HINT}",
        code=1,
    )


def mtime_ms(path: Path) -> int | None:
    return int(path.stat().st_mtime * 1000) if path.is_file() else None


# ---------------------------------------------------------------- TensorBoard


def tensorboard_folder(run: RunRecord, target: Target) -> Path:
    root = Path(target.where) if target.where else run.path.resolve().parent / "tensorboard"
    return root / run.path.resolve().name


def png_size(data: bytes) -> tuple[int, int]:
    """(height, width) from a PNG's header."""
    width, height = struct.unpack(">II", data[16:24])
    return height, width


def tensorboard_summaries(run: RunRecord) -> Iterator[tuple[int, Any]]:
    """(step, summary) for each piece of the publication, in TensorBoard's own protos."""
    from tensorboard.plugins.scalar.summary_v2 import scalar_pb  # optional

    for tag, step, value in scalars(run):
        yield step, scalar_pb(tag, value)
    for tag, value in finals(run).items():
        yield run.last_step, scalar_pb(tag, value)
    yield 0, hparams_summary(run, start=True)
    for path in artifacts(run):
        yield run.last_step, file_summary(path)
    if run.summary is not None:
        yield run.last_step, hparams_summary(run, start=False)


def file_summary(path: Path) -> Any:
    """A chart as an image (charts/<file>), any other file as text (files/<file>)."""
    from tensorboard.compat.proto import summary_pb2  # optional
    from tensorboard.plugins.text.summary_v2 import text_pb  # optional

    if path.suffix != ".png":
        text = path.read_text(errors="replace")
        return text_pb(f"files/{path.name}", text if path.suffix == ".md" else f"```\n{text}\n```")
    data = path.read_bytes()
    height, width = png_size(data)
    image = summary_pb2.Summary.Image(
        height=height, width=width, colorspace=4, encoded_image_string=data
    )
    return summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=f"charts/{path.name}", image=image)]
    )


def hparams_summary(run: RunRecord, start: bool) -> Any:
    """The hparams plugin's session start (the config) or end, as its summary protos."""
    from tensorboard.compat.proto import summary_pb2  # optional
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2  # optional

    data = plugin_data_pb2.HParamsPluginData()
    if start:
        info = data.session_start_info
        for key, value in hparams(run).items():
            if isinstance(value, bool):
                info.hparams[key].bool_value = value
            elif isinstance(value, float | int):
                info.hparams[key].number_value = value
            else:
                info.hparams[key].string_value = value
        tag = metadata.SESSION_START_INFO_TAG
    else:
        data.session_end_info.status = api_pb2.STATUS_SUCCESS
        tag = metadata.SESSION_END_INFO_TAG
    value = summary_pb2.Summary.Value(
        tag=tag, metadata=metadata.create_summary_metadata(data), tensor=metadata.NULL_TENSOR
    )
    return summary_pb2.Summary(value=[value])


def write_tensorboard(run: RunRecord, folder: Path, mark: dict) -> None:
    """The run's event file in folder, through tensorboard's event file writer, and the
    marker beside it, last."""
    try:
        write_events(run, folder)
    except ImportError:
        raise missing("tensorboard", "tensorboard") from None
    (folder / MARKER).write_text(json.dumps(mark, indent=1) + "\n")


def write_events(run: RunRecord, folder: Path) -> None:
    """One event per step, in step order: TensorBoard reads a step below one it has seen as
    the mark of a restart, and drops the points written after it."""
    from tensorboard.compat.proto import event_pb2  # optional
    from tensorboard.summary.writer.event_file_writer import EventFileWriter  # optional

    by_step: dict[int, Any] = {}
    for step, summary in tensorboard_summaries(run):
        if step in by_step:
            by_step[step].value.extend(summary.value)
        else:
            by_step[step] = summary
    writer = EventFileWriter(str(folder), max_queue_size=1000)
    now = time.time()
    try:
        for step in sorted(by_step):
            writer.add_event(event_pb2.Event(wall_time=now, step=step, summary=by_step[step]))
    finally:
        writer.close()


def read_marker(folder: Path) -> dict | None:
    try:
        mark = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return mark if isinstance(mark, dict) else None


def publish_tensorboard(run: RunRecord, folder: Path) -> str:
    """Writes the run's folder aside and swaps it in whole; the same publication again is
    left as it is. A folder that is not a publication of this run is never replaced."""
    mark = {"run_dir": str(run.path.resolve()), "fingerprint": fingerprint(run)}
    old = read_marker(folder) if folder.is_dir() else None
    if folder.exists() and old is None and any(folder.iterdir()):
        raise UserError(
            f"{folder} exists and is not a publication of a run (no {MARKER}); "
            "remove it or publish elsewhere: TO=tensorboard:DIR"
        )
    if old is not None and old.get("run_dir") != mark["run_dir"]:
        raise UserError(
            f"{folder} holds the publication of another run ({old.get('run_dir')}); "
            "publish this one elsewhere: TO=tensorboard:DIR"
        )
    if old is not None and old.get("fingerprint") == mark["fingerprint"]:
        return f"{run.path}: up to date in TensorBoard folder {folder}, nothing written"
    folder.parent.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.new-", dir=folder.parent))
    try:
        write_tensorboard(run, aside, mark)
        if folder.exists():
            gone = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            folder.rename(gone / folder.name)
            aside.rename(folder)
            shutil.rmtree(gone)
        else:
            aside.rename(folder)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return f"{run.path}: published to TensorBoard folder {folder}"


# ---------------------------------------------------------------- MLflow


def mlflow_uri(run: RunRecord, target: Target, env: Mapping[str, str]) -> str:
    if target.where:
        return target.where
    if env.get("MLFLOW_TRACKING_URI"):
        return env["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{run.path.resolve().parent / 'mlflow.db'}"


def sqlite_file(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def mlflow_client(uri: str) -> Any:
    """MLflow's client on uri, its store opened (a new sqlite file created): a missing
    package, or a store that cannot be reached, is one line."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # publishing sends nothing else
    try:
        from mlflow.exceptions import MlflowException  # optional
        from mlflow.tracking import MlflowClient  # optional
    except ImportError:
        raise missing("mlflow", "mlflow-skinny sqlalchemy alembic") from None
    for name in ("mlflow", "alembic"):  # a new store's set-up says nothing
        logging.getLogger(name).setLevel(logging.WARNING)
    if (db := sqlite_file(uri)) is not None:
        db.resolve().parent.mkdir(parents=True, exist_ok=True)
    try:
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    except ImportError as err:
        raise missing(f"{err.name} for MLflow at {uri}", err.name or "mlflow") from None
    except MlflowException as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"MLflow at {uri}: {first}", code=1) from None
    return client


def mlflow_experiment(client: Any, run: RunRecord, uri: str) -> str:
    """The id of the experiment named after the run's recipe, made (or restored) if need be;
    a new one on a sqlite file keeps its artifacts beside the file."""
    name = run.recipe or run.path.resolve().parent.name
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        return found.experiment_id
    db = sqlite_file(uri)
    where = (db.resolve().parent / "mlartifacts" / name).as_uri() if db else None
    return client.create_experiment(name, artifact_location=where)


def publish_mlflow(client: Any, run: RunRecord, uri: str) -> str:
    """The run's MLflow run: left as it is when it holds this publication, else written anew
    and any older one of the same run directory deleted, so that one run stays."""
    experiment = mlflow_experiment(client, run, uri)
    key, mark = run_key(run), fingerprint(run)
    older = client.search_runs([experiment], filter_string=f"tags.`{TAG_KEY}` = '{key}'")
    same = [r for r in older if r.data.tags.get(TAG_FINGERPRINT) == mark]
    for stale in older:  # a cut-short or outdated publication, or a second copy
        if stale.info.run_id != (same[0].info.run_id if same else None):
            client.delete_run(stale.info.run_id)
    if same:
        return f"{run.path}: up to date in MLflow run {same[0].info.run_id} ({uri})"
    run_id = write_mlflow(client, experiment, run, key)
    client.set_tag(run_id, TAG_FINGERPRINT, mark)  # last: the publication is whole
    return f"{run.path}: published as MLflow run {run_id} ({uri})"


def write_mlflow(client: Any, experiment: str, run: RunRecord, key: str) -> str:
    from mlflow.entities import Metric, Param  # optional

    tags = {TAG_KEY: key, TAG_DIR: str(run.path.resolve()), "recipes.recipe": run.recipe or ""}
    if isinstance(sha := run.env.get("git_sha"), str):
        tags["mlflow.source.git.commit"] = sha
    start = mtime_ms(run.path / "config.yaml") or int(time.time() * 1000)
    made = client.create_run(experiment, start_time=start, tags=tags, run_name=run.path.name)
    run_id = made.info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(tag, value, now, step) for tag, step, value in scalars(run)]
    metrics += [Metric(tag, value, now, run.last_step) for tag, value in finals(run).items()]
    for i in range(0, len(metrics), MLFLOW_BATCH):
        client.log_batch(run_id, metrics=metrics[i : i + MLFLOW_BATCH], synchronous=True)
    params = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in hparams(run).items()]
    for i in range(0, len(params), MLFLOW_PARAMS):
        client.log_batch(run_id, params=params[i : i + MLFLOW_PARAMS], synchronous=True)
    for path in artifacts(run):
        client.log_artifact(run_id, str(path), "reports" if path in reports(run) else None)
    if run.summary is not None:  # an unfinished run stays RUNNING until published finished
        client.set_terminated(run_id, "FINISHED", mtime_ms(run.path / "summary.json"))
    return run_id


# ---------------------------------------------------------------- the command


def read_runs(paths: list[str]) -> list[RunRecord]:
    found = [runs.read_run(p) for p in paths]
    where = [r.path.resolve() for r in found]
    for i, path in enumerate(where):
        if path in where[:i]:
            raise UserError(f"{paths[i]} is given twice; name each run once")
    return found


def destinations(found: list[RunRecord], target: Target, env: Mapping[str, str]) -> list[str]:
    if target.kind == "tensorboard":
        folders = [tensorboard_folder(run, target) for run in found]
        for i, folder in enumerate(folders):
            if folder in folders[:i]:
                raise UserError(
                    f"two runs named {folder.name} would share {folder}; publish them apart"
                )
        return [str(f) for f in folders]
    return [mlflow_uri(run, target, env) for run in found]


def viewer_hint(target: Target, where: list[str]) -> str:
    if target.kind == "tensorboard":
        logdirs = sorted({str(Path(w).parent) for w in where})
        return "view: " + " ; ".join(f"tensorboard --logdir {d}" for d in logdirs)
    uris = sorted(set(where))
    return "view: " + " ; ".join(f"mlflow ui --backend-store-uri {u}" for u in uris)


def main(args: argparse.Namespace, env: Mapping[str, str], dry: bool) -> int:
    target = parse_target(args, env)
    found = read_runs(report.run_paths(args, env, "publish"))
    where = destinations(found, target, env)
    if dry:
        for run, dest in zip(found, where, strict=True):
            print(f"{run.path} -> {target.kind} {dest}")
        print("(dry run: nothing written)")
        return 0
    for run in found:
        for note in run.metrics.notes:
            print(f"launch: warning: {printable(note)}", file=sys.stderr)
        if run.summary is None:
            print(
                f"launch: warning: {run.path} has no summary.json (running or stopped): "
                "published as it stands; publish it again when it finishes",
                file=sys.stderr,
            )
    clients: dict[str, Any] = {}
    for run, dest in zip(found, where, strict=True):
        try:
            if target.kind == "tensorboard":
                print(publish_tensorboard(run, Path(dest)))
                continue
            if dest not in clients:
                clients[dest] = mlflow_client(dest)
            print(publish_mlflow(clients[dest], run, dest))
        except OSError as err:
            raise UserError(
                f"cannot publish {run.path} to {dest} ({err.strerror}: {err.filename})", code=1
            ) from None
        except Exception as err:  # MLflow's own errors (its package is imported only here)
            if not type(err).__module__.startswith("mlflow"):
                raise
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"MLflow at {dest}: {first}", code=1) from None
    print(viewer_hint(target, where))
    return 0
