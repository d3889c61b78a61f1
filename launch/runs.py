"""Reading run directories as the engine leaves them (config.yaml, env.json, summary.json,
metrics.jsonl): for watching runs (launch.watch), a sweep's members (launch.sweep_members) and the
analysis's reports and charts (launch.analysis). A run that is still going, stopped early,
resumed or never evaluated reads as whatever is there; a path that is not a run is one
UserError.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine import results
from engine.config import load_yaml
from launch.errors import UserError

# The engine creates it as a run starts (right after config.yaml); a recipe folder, which has
# a config.yaml too, never holds one.
MARKER = "metrics.jsonl"
# Settings that name, place, log or pause a run without changing what it trains.
# Not settings: where a run went and what it logged (run., log.), how it asked the scheduler
# for a place (slurm.) and how often it saved (ckpt.): none changes what it trains (a resume is
# bitwise), so runs differing only in them are one cell.
BOOKKEEPING_PREFIXES = ("run.", "log.", "slurm.", "ckpt.")
BOOKKEEPING = ("resume", "train.stop_at_step")
UNSET = "(unset)"
# Not a config key: the data a run trained on (env.json's "data" fingerprints), a setting in
# which runs may differ. A run recorded before runs named their data differs from none.
DATA = "data"
# An evaluation record's keys that are not metrics: summary.json leaves them out too.
EVAL_BOOKKEEPING = ("kind", "step", "epoch", "count", "skipped")
WHERE = "give a run directory, runs/<recipe>/<run name>"
FINISHED = "finished"


@dataclass
class Metrics:
    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    world_changes: list[dict] = field(default_factory=list)  # elastic restarts, in file order
    code_changes: list[dict] = field(default_factory=list)  # run.allow_code_change resumes
    requeues: list[dict] = field(default_factory=list)  # SLURM starts again, with their cause
    data_changes: list[dict] = field(default_factory=list)  # run.allow_data_change resumes
    notes: list[str] = field(default_factory=list)  # lines skipped, said to the user


@dataclass(frozen=True)
class Headline:
    """The metric a run is judged by, as summary.json names it, and its direction."""

    key: str  # "top1", "eval_loss"
    higher_is_better: bool

    @property
    def metric(self) -> str:
        """Its name in the evaluation records ("top1", "loss")."""
        return results.eval_name(self.key)


@dataclass
class Member:
    """One run of a sweep's or a comparison's cell: its run name and seed, where it is, and
    how it stands."""

    name: str
    seed: int | None
    path: Path
    status: str = "missing"  # finished | unfinished | failed | queued | missing | duplicate
    summary: dict | None = None  # summary.json, once finished
    last_line: str | None = None  # of its log, for one that failed or stopped

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


@dataclass
class RunRecord:
    path: Path
    name: str  # as shown in legends and tables; report.py may qualify it
    config: dict[str, Any]  # flattened: {"optim.lr": 0.1, ...}
    env: dict[str, Any]
    summary: dict[str, Any] | None  # None until the run finishes
    metrics: Metrics
    checkpoint_step: int = 0  # of its newest checkpoint (0: none)

    @property
    def recipe(self) -> str | None:
        """The recipe that trained it, as its config.yaml names it (None: not recorded)."""
        recipe = self.config.get("recipe")
        return recipe if isinstance(recipe, str) and recipe else None

    @property
    def world_size(self) -> Any:
        return (self.summary or {}).get("world_size", self.env.get("world_size"))

    @property
    def last_step(self) -> int:
        """The furthest step it recorded: a stopped run checkpoints after its last record."""
        records = self.metrics.train + self.metrics.eval
        return max([self.checkpoint_step, *(r["step"] for r in records)])

    @property
    def last_eval(self) -> dict | None:
        return self.metrics.eval[-1] if self.metrics.eval else None

    @property
    def results(self) -> dict[str, Any]:
        """Its metrics by summary.json's names: summary.json's once it finished, else those of
        its last evaluation (a run stopped, preempted or still running), else none."""
        if self.summary is not None:
            return self.summary
        return eval_results(self.last_eval) if self.last_eval else {}

    @property
    def headline(self) -> Headline:
        return find_headline(self.summary, self.env, self.metrics.eval)


def recorded_headline(
    summary: dict[str, Any] | None, env: dict[str, Any] | None
) -> Headline | None:
    """The headline the run recorded: summary.json's at the end, env.json's "task" from the
    start (the recipe's task declares it); None for a run that recorded neither."""
    recorded = results.headline(summary, env)
    return Headline(*recorded) if recorded is not None else None


def find_headline(
    summary: dict[str, Any] | None, env: dict[str, Any] | None, eval_records: list[dict]
) -> Headline:
    """The headline the run recorded, else the old rule (below)."""
    recorded = recorded_headline(summary, env)
    if recorded is not None:
        return recorded
    # Only for runs written before the engine recorded the headline and its direction: top-1
    # where their evaluations record it, else the loss.
    if any("top1" in r for r in eval_records):
        return Headline("top1", higher_is_better=True)
    return Headline(results.summary_name("loss"), higher_is_better=False)


def shared_headline(found: list[RunRecord]) -> Headline:
    """The headline of runs shown together: the first one's that recorded it (runs written
    before the engine recorded it have none), else the first run's by the old rule."""
    recorded = (recorded_headline(run.summary, run.env) for run in found)
    return next((h for h in recorded if h is not None), found[0].headline)


def eval_results(record: dict) -> dict[str, Any]:
    """An evaluation record's metrics named as summary.json names them ("loss": "eval_loss")."""
    return {results.summary_name(k): v for k, v in record.items() if k not in EVAL_BOOKKEEPING}


# ---------------------------------------------------------------- metrics.jsonl


def _record(raw: bytes) -> dict | None:
    """A metrics record, or None for a line that is not one."""
    try:
        record = json.loads(raw)
    except ValueError:  # JSONDecodeError and undecodable bytes alike
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None
    step = record.get("step")
    return record if isinstance(step, int) and not isinstance(step, bool) else None


def read_metrics(path: Path) -> Metrics:
    """Train and eval records by step. A line that does not parse is skipped and noted: the
    last one is torn when a run is writing it now or was killed while writing it. Where a
    step was recorded twice (a resumed run repeats the steps after its checkpoint) the last
    record wins."""
    if not path.is_file():
        return Metrics(notes=[f"{path}: missing, so no curves for this run"])
    data = path.read_bytes()  # once: a live run keeps appending
    lines = data.split(b"\n")
    latest: dict[tuple[str, int], dict] = {}
    notes = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        record = _record(raw)
        if record is None:
            torn = number == len(lines)  # no newline after it: written only in part
            why = "torn (written only in part)" if torn else "not a metrics record"
            notes.append(f"{path}: line {number} skipped, {why}")
            continue
        latest.pop((record["kind"], record["step"]), None)  # keep file order for the rest
        latest[(record["kind"], record["step"])] = record
    ordered = sorted(latest.values(), key=lambda r: r["step"])
    return Metrics(
        train=[r for r in ordered if r["kind"] == "train"],
        eval=[r for r in ordered if r["kind"] == "eval"],
        world_changes=[r for r in latest.values() if r["kind"] == "world_size"],
        code_changes=[r for r in latest.values() if r["kind"] == "code"],
        requeues=[r for r in latest.values() if r["kind"] == "requeue"],
        data_changes=[r for r in latest.values() if r["kind"] == "data"],
        notes=notes,
    )


# ---------------------------------------------------------------- a run directory


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 0.1}} -> {"optim.lr": 0.1}, the keys overrides are written with."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_json(path: Path, notes: list[str]) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_bytes())
    except ValueError:
        notes.append(f"{path}: not valid JSON, left out")
        return None
    return value if isinstance(value, dict) else None


def read_config(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        tree = load_yaml(path.read_bytes())
    except yaml.YAMLError:
        notes.append(f"{path}: not valid YAML, its settings left out")
        return {}
    return flatten(tree) if isinstance(tree, dict) else {}


def newest_checkpoint_step(folder: Path) -> int:
    """The step of the newest checkpoint the engine left (step-<n>.pt or a sharded step-<n>/),
    0 for none; partial ones are hidden (.step-*) and not counted."""
    if not folder.is_dir():
        return 0
    steps = [p.name.removeprefix("step-").removesuffix(".pt") for p in folder.glob("step-*")]
    return max((int(s) for s in steps if s.isdigit()), default=0)


def check_run_dir(text: str) -> Path:
    """The path as a run directory, or one UserError saying what it is instead."""
    path = Path(text)
    try:
        if not path.exists():
            raise UserError(f"{text}: no such directory; {WHERE}")
        if not path.is_dir():
            raise UserError(f"{text} is a file, not a run directory; {WHERE}")
        if (path / MARKER).is_file():
            return path
        inside = sorted(p.name for p in path.iterdir())
    except OSError as err:
        raise UserError(f"{text}: cannot read it ({err.strerror}); {WHERE}") from None
    if not inside:
        raise UserError(f"{text} is an empty directory, not a run; {WHERE}")
    runs = [name for name in inside if (path / name / MARKER).is_file()]
    if runs:
        example = " ".join(f"{text.rstrip('/')}/{name}" for name in runs[:2])
        raise UserError(f"{text} holds runs, not a run's files; name the runs: RUNS='{example}'")
    raise UserError(f"{text} is not a run directory (it has no {MARKER}); {WHERE}")


def expand(word: str) -> list[str]:
    """A pattern's matches, sorted (a pattern that matches nothing: one line); else the word."""
    if not any(c in word for c in "*?["):
        return [word]
    matches = sorted(glob.glob(word))
    if not matches:
        raise UserError(f"RUNS: {word} matches no path; check the pattern")
    return matches


def read_run(text: str) -> RunRecord:
    path = check_run_dir(text)
    try:
        metrics = read_metrics(path / "metrics.jsonl")
        notes = metrics.notes
        return RunRecord(
            path=path,
            name=path.resolve().name,
            config=read_config(path / "config.yaml", notes),
            env=read_json(path / "env.json", notes) or {},
            summary=read_json(path / "summary.json", notes),
            metrics=metrics,
            checkpoint_step=newest_checkpoint_step(path / "checkpoints"),
        )
    except OSError as err:
        raise UserError(f"{text}: cannot read {err.filename} ({err.strerror})") from None


# ---------------------------------------------------------------- what differs between runs


def data_of(run: RunRecord) -> dict[str, Any] | None:
    """The fingerprints of the data it trained on (env.json's, else summary.json's); None
    for a run recorded before runs named their data."""
    for source in (run.env, run.summary or {}):
        found = source.get(DATA)
        if isinstance(found, dict) and found:
            return found
    return None


def data_identity(run: RunRecord) -> str | None:
    """Its data in a few characters, `train 1a2b3c4d eval 5e6f7a8b` (their sha256s)."""
    found = data_of(run)
    if found is None:
        return None
    parts = [
        f"{split} {str(fp.get('sha256'))[:8]}"
        for split, fp in found.items()
        if isinstance(fp, dict)
    ]
    return " ".join(parts)


def data_note(found: list[RunRecord]) -> str | None:
    """One line for runs that did not all train on the same data, else None."""
    seen: dict[str, RunRecord] = {}
    for run in found:
        identity = data_identity(run)
        if identity is not None:
            seen.setdefault(identity, run)
    if len(seen) < 2:
        return None
    described = "; ".join(
        f"{identity}: "
        + ", ".join(
            f"{split} {fp.get('summary', '?')}" for split, fp in (data_of(run) or {}).items()
        )
        for identity, run in seen.items()
    )
    return (
        f"note: these runs trained on different data ({described}): runs on other data are "
        "kept in groups of their own, never pooled"
    )


def settings(run: RunRecord) -> dict[str, Any]:
    """What a run was asked to do: its config without bookkeeping, its world size (not a
    config value, but two runs differing only in it are told apart by it) and the data it
    trained on (DATA; absent for a run that recorded none)."""
    kept = {
        k: v
        for k, v in run.config.items()
        if not k.startswith(BOOKKEEPING_PREFIXES) and k not in BOOKKEEPING
    }
    data = data_identity(run)
    return kept | {"world_size": run.world_size} | ({DATA: data} if data else {})


def _same_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def differing(runs: list[RunRecord]) -> list[str]:
    """The settings keys whose values are not the same in every run, sorted."""
    each = [settings(run) for run in runs]
    keys = sorted(set().union(*each))

    def values(key: str) -> set[str]:
        found = {_same_key(s.get(key, UNSET)) for s in each}
        # data that a run did not record is not known to differ from the others'
        return found - {_same_key(UNSET)} if key == DATA else found

    return [k for k in keys if len(values(k)) > 1]


def value_text(value: Any) -> str:
    """A value as an override would write it: optim.name=sgd, train.amp=true, betas=[0.9, 1]."""
    if isinstance(value, str):
        return value or "''"
    return json.dumps(value)


def overrides(run: RunRecord, keys: list[str]) -> list[str]:
    values = settings(run)
    return [f"{k}={value_text(values.get(k, UNSET))}" for k in keys]
