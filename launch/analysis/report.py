"""`python -m launch report RUN_DIR...` (`make report RUNS="runs/digits/a runs/digits/b"`): a
chart of the runs' curves and a Markdown summary of them, from the run directories alone.

Both land next to the runs, in their common parent folder, named after the run set:
`report-<names>.png` and `report-<names>.md`, the run names sorted and joined with '+' (a long
set: the first name, how many more, and a hash of all of them). Running it again on the same
runs replaces them. The chart draws several runs over each other, each named in the legend by
its run name and the settings in which it differs from the others.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shlex
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

from launch import runs
from launch.analysis import charts
from launch.errors import UserError, printable
from launch.runs import RunRecord

# shown as "time" and "world size"; the headline's name orders the columns instead, and its
# direction is not a metric, nor are the files of the best checkpoints
OWN_COLUMNS = (
    "seconds",
    "world_size",
    "headline",
    "higher_is_better",
    "best_checkpoints",
    "code",
    "data",
)
MAX_STEM = 120
DIGITS = 4  # significant digits of a float in the table (summary.json has them all)


def run_paths(
    args: argparse.Namespace, env: Mapping[str, str], command: str = "report"
) -> list[str]:
    """The run directories: the command's arguments, else RUNS (split as a shell would, a
    word with *, ? or [ expanded as a shell would: RUNS="runs/digits/lr-*")."""
    if args.overrides:
        return list(args.overrides)
    try:
        words = shlex.split(env.get("RUNS", ""))
    except ValueError as err:
        raise UserError(f"RUNS cannot be split into paths ({err}); check its quotes") from None
    if not words:
        raise UserError(
            f'no runs given; make {command} RUNS="runs/digits/a runs/digits/b", '
            f"or python -m launch {command} RUN_DIR..."
        )
    return [path for word in words for path in runs.expand(word)]


def read_runs(paths: list[str]) -> list[RunRecord]:
    """Each run, named by its path from the runs' common parent (its bare name when they
    share a parent, as runs of one recipe do)."""
    found = [runs.read_run(p) for p in paths]
    where = [r.path.resolve() for r in found]
    for i, path in enumerate(where):
        if path in where[:i]:
            raise UserError(f"{paths[i]} is given twice; name each run once")
    parent = common_parent(found)
    for run, path in zip(found, where, strict=True):
        run.name = str(path.relative_to(parent))
    return found


def common_parent(found: list[RunRecord]) -> Path:
    return Path(os.path.commonpath([r.path.resolve().parent for r in found]))


def output_stem(found: list[RunRecord]) -> str:
    names = sorted(r.name.replace(os.sep, "_") for r in found)
    stem = "report-" + "+".join(names)
    if len(stem) <= MAX_STEM:
        return stem
    digest = hashlib.sha256("\n".join(names).encode(errors="surrogateescape")).hexdigest()[:8]
    return f"report-{names[0][:60]}+{len(names) - 1}-more-{digest}"


def labels(found: list[RunRecord]) -> list[str]:
    """Legend entries: the run name and the settings that differ between the runs."""
    keys = runs.differing(found)
    return [" ".join([f"{run.name}:", *runs.overrides(run, keys)]).rstrip(":") for run in found]


# ---------------------------------------------------------------- the Markdown summary


def metric_columns(found: list[RunRecord], headline: str) -> list[str]:
    """The runs' metric keys (summary.json's, or an unfinished run's last evaluation's by the
    same names) in the engine's order, the headline first."""
    keys: list[str] = []
    for run in found:
        keys += [k for k in run.results if k not in keys and k not in OWN_COLUMNS]
    return sorted(keys, key=lambda k: k != headline)  # stable: the rest keep their order


def duration(seconds) -> str:
    if not isinstance(seconds, int | float):
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = round(seconds) // 60
    if minutes < 60:
        return f"{minutes} min {round(seconds) % 60:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def commit_text(env: Mapping) -> str:
    sha = env.get("git_sha")
    if not isinstance(sha, str):
        return "n/a"
    return sha[:12] + (" (dirty)" if env.get("git_dirty") else "")


def status(run: RunRecord) -> str:
    if run.summary is not None:
        return "finished"
    said = f"no summary.json yet, at step {run.last_step} (running or stopped)"
    if run.last_eval is not None:
        said += f"; metrics of its last evaluation, at step {run.last_eval['step']}"
    return said


def number(value: float) -> str:
    """A float to 4 significant digits (0.1003, 2.304, 1235; 1.235e-05 when tiny), never in
    the exponent form for a large one (123457); ints, booleans and the rest as JSON writes
    them (24, true, NaN)."""
    if not isinstance(value, float) or not math.isfinite(value):
        return json.dumps(value)
    text = f"{value:.{DIGITS}g}"
    if "e" in text and abs(value) >= 1:
        text = f"{value:.0f}"
    return text


def init_text(init: dict) -> str:
    """The first weights (engine.weights' record) in short: the file's name or the named
    weights, and how many tensors were loaded, re-initialised and left unused."""

    def count(key: str) -> str:
        value = init.get(key)
        return str(len(value) if isinstance(value, list) else value if value is not None else "?")

    source = init.get("weights") or init.get("name") or Path(str(init.get("file", "?"))).name
    return (
        f"{source}: {count('loaded')} loaded, {count('reinitialised')} re-initialised, "
        f"{count('unused')} unused"
    )


def value_text(value) -> str:
    """A recorded value as a table shows it: numbers to 4 significant digits, the init record
    in short, anything else as JSON, cut short."""
    if isinstance(value, dict) and "loaded" in value:
        return init_text(value)
    if isinstance(value, dict | list):
        return textwrap.shorten(json.dumps(value), 60, placeholder=" ...")
    return number(value)


def cell(run: RunRecord, column: str, headline: str) -> str:
    """A metric as recorded, to 4 significant digits, '–' where the run has none. An
    unfinished run's headline says that it is the last evaluation's, and of which step."""
    results = run.results
    if column not in results:
        return "–"
    text = value_text(results[column])
    if run.summary is None and column == headline:
        text += f" (at step {run.last_eval['step']}, unfinished)"
    return text


def row(run: RunRecord, columns: list[str], keys: list[str], headline: str) -> str:
    """Metrics as summary.json holds them, or as the last evaluation recorded them."""
    summary = run.summary or {}
    cells = [
        run.name,
        status(run),
        *(cell(run, c, headline) for c in columns),
        duration(summary.get("seconds")),
        str(run.world_size) if run.world_size is not None else "n/a",
        commit_text(run.env),
        " ".join(runs.overrides(run, keys)),
    ]
    return "| " + " | ".join(text.replace("|", "\\|") for text in cells) + " |"


def markdown(found: list[RunRecord], chart: str | None, headline: str) -> str:
    """The summary; `chart` is the chart's file name (None: no chart, no picture)."""
    columns = metric_columns(found, headline)
    keys = runs.differing(found)
    head = ["run", "status", *columns, "time", "world size", "git", "differs"]
    differs = ", ".join(keys) if keys else "nothing"
    if len(found) == 1:
        differs = "one run, nothing to compare"
    picture = [
        f"![Training loss, learning rate, evaluation metrics, samples/s and data-wait "
        f"fraction against optimizer steps]({chart})",
        "",
    ]
    lines = [
        f"# Runs: {', '.join(r.name for r in found)}",
        "",
        *(picture if chart else []),
        "| " + " | ".join(head) + " |",
        "|---|---|" + "---:|" * (len(columns) + 2) + "---|---|",
        *(row(run, columns, keys, headline) for run in found),
        "",
        f"Final metrics from each run's summary.json, to {DIGITS} significant digits (the "
        "file has them in full). Settings that differ between the runs (their config.yaml, "
        f"names, folders and logging aside): {differs}.",
    ]
    if any(run.summary is None and run.last_eval is not None for run in found):
        lines += [
            "",
            "A run without summary.json (stopped, preempted or still running) shows the "
            "metrics of its last evaluation in metrics.jsonl, not final ones; resuming it "
            "(the same run.name) finishes it.",
        ]
    lines += (
        time_breakdown(found)
        + worker_time(found)
        + profiles(found)
        + world_changes(found)
        + requeues(found)
    )
    lines += resumed_changes(found, "code") + resumed_changes(found, "data")
    notes = [note for run in found for note in run.metrics.notes] + untrained_notes(found)
    if notes:
        lines += ["", "Notes:", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


# the shares of a window's wall time the engine records (engine.meter.Meter.breakdown), in
# the order a batch meets them; a column only where some run recorded it
TIME_SHARES = (
    ("data_wait", "data wait"),
    ("to_device", "to device"),
    ("step_host", "step (host)"),
    ("sync", "sync"),
    ("checkpoint", "checkpoint"),
    ("forward_backward", "forward + backward"),
    ("optimizer", "optimizer"),
    ("read", "read"),
    ("decode", "decode"),
    ("augment", "augment"),
    ("finish_thread", "finishing thread busy"),
    ("gpu_data_wait", "GPU waits for data"),
)


def time_breakdown(found: list[RunRecord]) -> list[str]:
    """Where each run's training time went: every share's mean over the run's windows, the
    first left out where there are others (it holds the loader workers' start)."""
    windows = {run.name: run.metrics.train[1:] or run.metrics.train for run in found}
    present = [
        (key, title)
        for key, title in TIME_SHARES
        if any(key in r for records in windows.values() for r in records)
    ]
    if not present:
        return []
    rows = []
    for run in found:
        records = windows[run.name]
        shares = [_mean(records, key) for key, _ in present]
        step = _mean(records, "step_s")
        cells = [
            run.name,
            "–" if step is None else f"{step:.4g} s",
            *("–" if share is None else f"{100 * share:.1f}%" for share in shares),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    head = ["run", "time per step", *(title for _, title in present)]
    return [
        "",
        "Where the training time went (shares of each logging window's wall time, averaged "
        "over the windows after the first): the training thread's waits and work (data wait, "
        "to device, step, sync and checkpoint add up to its time but for the loop's "
        "bookkeeping), then the "
        "input stages run in the training process, on either thread.",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
        *rows,
    ]


WORKER_STAGES = ("read", "decode", "augment")  # engine.data.stages.WORKER_STAGES


def worker_time(found: list[RunRecord]) -> list[str]:
    """Where the loader workers' time went: each run's mean seconds of worker time per batch
    in reading, decoding and augmenting its samples (the windows after the first)."""
    keys = [f"worker_{stage}_s" for stage in WORKER_STAGES]
    windows = {run.name: run.metrics.train[1:] or run.metrics.train for run in found}
    if not any(k in r for records in windows.values() for r in records for k in keys):
        return []
    rows = []
    for run in found:
        means = [_mean(windows[run.name], key) for key in keys]
        cells = [run.name, *("–" if m is None else f"{m:.4g} s" for m in means)]
        rows.append("| " + " | ".join(cells) + " |")
    return [
        "",
        "The loader workers' time per batch (seconds of worker time, summed over a batch's "
        "samples and averaged over the windows after the first): where a starving run's "
        "workers spend it.",
        "",
        "| run | read | decode | augment |",
        "|---|---:|---:|---:|",
        *rows,
    ]


PROFILE_PHASES = ("data wait", "forward", "backward", "optimizer")  # engine.profile.PHASES
PROFILE_TOP = 5  # operators named per profile in the report


def profiles(found: list[RunRecord]) -> list[str]:
    """The traces recorded with prof.steps (engine.profile's summaries beside them): per
    rank, the phases' share of the traced steps and the top operators by self time."""
    rows = []
    for run in found:
        for path in sorted((run.path / "profile").glob("*.summary.json")):
            try:
                summary = json.loads(path.read_text())
                rows.append(_profile_row(run.name, summary))
            except (OSError, ValueError, KeyError, TypeError):
                rows.append(f"| {run.name} | {path.name}: unreadable | | | | | |")
    if not rows:
        return []
    head = ["run", "rank, steps", *PROFILE_PHASES, f"top {PROFILE_TOP} operators (self time)"]
    return [
        "",
        "Profiles (prof.steps; traces in each run's profile/ folder, for chrome://tracing or "
        "ui.perfetto.dev): the phases' share of the traced steps' host time (on CUDA, of "
        "their device time, data wait aside), and the operators that took the most self time "
        "(the device's on CUDA).",
        "",
        "| " + " | ".join(head) + " |",
        "|---|---|" + "---:|" * len(PROFILE_PHASES) + "---|",
        *rows,
    ]


def _profile_row(name: str, summary: dict) -> str:
    shares = []
    for phase in PROFILE_PHASES:  # data wait is the host's; the others the device's on CUDA
        on_device = summary.get("device") == "cuda" and phase != "data wait"
        total = summary["steps_device_ms"] if on_device else summary["steps_ms"]
        ms = summary["phases"].get(phase, {}).get("device_ms" if on_device else "host_ms")
        shares.append("–" if ms is None or not total else f"{100 * ms / total:.1f}%")
    first, last = summary["steps"]
    ops = ", ".join(
        f"{op['name']} {op['self_ms']:.3g} ms" for op in summary["top_ops"][:PROFILE_TOP]
    )
    cells = [name, f"{summary['rank']}, {first}-{last if last is not None else 'end'}"]
    return "| " + " | ".join(c.replace("|", "\\|") for c in [*cells, *shares, ops]) + " |"


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), int | float)]
    return sum(values) / len(values) if values else None


def untrained_notes(found: list[RunRecord]) -> list[str]:
    """A run that has evaluations or a summary but no training record ended before its
    first one (the engine writes one every log.every_steps steps): said, so that its empty
    training panels do not read as a run that never started."""
    notes = []
    for run in found:
        if run.metrics.train or not (run.metrics.eval or run.summary is not None):
            continue
        steps = (run.summary or {}).get("steps", run.last_step)
        every = run.config.get("log.every_steps", "?")
        notes.append(
            f"{run.name}: no training records, its {steps} steps being fewer than "
            f"log.every_steps={every}; the chart shows its evaluations only"
        )
    return notes


def world_changes(found: list[RunRecord]) -> list[str]:
    """The table of the runs' changes of world size (an elastic run that lost or gained a
    node, a job requeued onto fewer nodes), as the engine recorded them; none: nothing."""
    changes = [(run, r) for run in found for r in run.metrics.world_changes]
    if not changes:
        return []

    rows = [
        f"| {run.name} | {r['step']} | {r.get('from')} → {r.get('to')} | "
        f"{r.get('checkpoint', 'n/a')} | {r.get('redone_steps', 'n/a')} | "
        f"{r.get('accum_steps', 'n/a')} × {r.get('micro_batch', 'n/a')} | {duration(r.get('lost_s'))} |"
        for run, r in changes
    ]
    return [
        "",
        "## Changes of world size",
        "",
        "| run | step | processes | resumed from | steps trained again | accumulation "
        "× micro batch | time lost |",
        "|---|---:|---|---|---:|---|---:|",
        *rows,
        "",
        "Each restart resumed from the newest checkpoint with the same global batch and "
        "sample order; the steps after that checkpoint were trained again (their records "
        "replaced), and the time lost runs from the checkpoint's writing to the restart.",
    ]


def requeues(found: list[RunRecord]) -> list[str]:
    """The table of the runs' SLURM requeues (preempted, a node lost, by hand), each with how
    the start before it ended; none: nothing."""
    rows = [
        f"| {run.name} | {r.get('restart')} | {r.get('job', 'n/a')} | {r['step']} | "
        f"{escape_cell(str(r.get('cause', 'n/a')))} |"
        for run in found
        for r in run.metrics.requeues
    ]
    if not rows:
        return []
    head = "| run | requeue | job | resumed at step | how the start before ended |"
    return ["", "## SLURM requeues", "", head, "|---|---:|---|---:|---|", *rows]


def escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# What a resume allowed to change, per kind: the report's heading and what it means.
RESUMED_CHANGES = {
    "code": (
        "Changes of code",
        "Each of these resumes continued the run with code other than the code that wrote its "
        "checkpoint (allowed by run.allow_code_change): the steps after it come from another "
        "program than the steps before.",
    ),
    "data": (
        "Changes of data",
        "Each of these resumes continued the run over data other than the data its checkpoint "
        "was trained on (allowed by run.allow_data_change).",
    ),
}


def resumed_changes(found: list[RunRecord], kind: str) -> list[str]:
    """The resumes that continued a run with other code or over other data (kind "code" or
    "data", allowed by run.allow_code_change or run.allow_data_change), as the engine recorded
    them; none: nothing."""
    changes = [(run, r) for run in found for r in getattr(run.metrics, f"{kind}_changes")]
    if not changes:
        return []
    heading, meaning = RESUMED_CHANGES[kind]
    rows = [
        f"| {run.name} | {r['step']} | {r.get('change', 'n/a')} | {r.get('checkpoint', 'n/a')} |"
        for run, r in changes
    ]
    return [
        "",
        f"## {heading}",
        "",
        "| run | step | change | resumed from |",
        "|---|---:|---|---|",
        *rows,
        "",
        meaning,
    ]


# ---------------------------------------------------------------- the command


def main(args: argparse.Namespace, env: Mapping[str, str], dry: bool) -> int:
    found = read_runs(run_paths(args, env))
    parent = common_parent(found)
    stem = output_stem(found)
    png, md = parent / f"{stem}.png", parent / f"{stem}.md"
    if dry:
        print(f"{png}\n{md}\n(dry run: nothing written)")
        return 0
    for note in (n for run in found for n in run.metrics.notes):
        print(f"launch: warning: {printable(note)}", file=sys.stderr)
    headline = runs.shared_headline(found)
    title = textwrap.shorten("Runs: " + ", ".join(r.name for r in found), 160, placeholder=" ...")
    chart: str | None = png.name
    try:
        try:
            charts.draw_runs(found, labels(found), headline, png, title)
        except charts.NoMatplotlib as err:  # the table is written all the same
            print(f"launch: warning: no chart: {err}", file=sys.stderr)
            chart = None
        md.write_text(markdown(found, chart, headline.key))
    except OSError as err:
        for path in (png, md):  # half a report is not left behind
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        raise UserError(
            f"cannot write the report in {parent} ({err.strerror}); make it writable", code=1
        ) from None
    print(f"{png}\n{md}" if chart else md)
    return 0
