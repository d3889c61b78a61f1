"""The engine as the measurements drive it: a run set up from a recipe and overrides (no W&B,
no progress bar, under the bench's scratch folder), n optimizer steps through its own loop,
its metrics records kept in memory, and its workers and lock released afterwards; the
throughput and breakdown of its metrics windows."""

from __future__ import annotations

import dataclasses

from bench.common import close_engine_run, start_engine_run
from bench.gpu.harness import Bench
from engine import catalog
from engine.config import ENGINE_SECTIONS
from engine.train import train_steps


def has_key(recipe_name: str, dotted: str) -> bool:
    """Whether this checkout's config knows `section.field` (switches land over time)."""
    section, _, name = dotted.partition(".")
    recipe = catalog.load(recipe_name)
    cls = {"model": recipe.model_config, "data": recipe.data_config}.get(section)
    cls = cls or ENGINE_SECTIONS.get(section)
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)}


def engine_run(bench: Bench, recipe: str, overrides: list[str], name: str, variant: str = ""):
    """bench.common's engine run, on the bench's device under its scratch folder."""
    root = bench.tmp / "runs"
    return start_engine_run(recipe, overrides, root, name, bench.device, variant)[0]


close_run = close_engine_run

# Where a train record's window went, as shares of its wall time (engine.meter.Meter.breakdown):
# the training thread's data_wait, to_device, step_host and sync, and the input stages run in
# this process (engine.data.stages). A stage that did not run is absent from a record: 0 here.
BREAKDOWN = (
    "data_wait",
    "to_device",
    "step_host",
    "sync",
    "decode",
    "augment",
    "finish_thread",
    "gpu_data_wait",
)


def engine_steps(run, n: int) -> None:
    """n optimizer steps through the engine's own loop (engine.train.train_steps), crossing
    epoch ends as it does, without the evaluation and checkpoint that fit() adds there."""
    train_steps(run, n)


def last_record(run) -> dict | None:
    """The figures of the engine's last train metrics record."""
    records = [r for r in run.records.tracker.records if r.get("kind") == "train"]
    if not records:
        return None
    keep = ("step", "samples_per_s", "data_wait", "mfu", "gpu_mem_gb")
    return {k: records[-1][k] for k in keep if k in records[-1]}


def window_rates(run, first_timed: int, batch: int) -> tuple[list[dict], float, dict]:
    """The train records of the windows after step `first_timed`: (records, images/s, the
    breakdown's shares), both weighted by each window's time."""
    records = [
        r
        for r in run.records.tracker.records
        if r.get("kind") == "train" and r["step"] > first_timed
    ]
    if not records:
        raise RuntimeError("the engine wrote no metrics records in the timed windows")
    window = run.cfg.log.every_steps
    seconds = [window * batch / r["samples_per_s"] for r in records]
    rate = len(records) * window * batch / sum(seconds)
    return records, rate, window_breakdown(records, seconds)


def window_breakdown(records: list[dict], seconds: list[float]) -> dict:
    """Each BREAKDOWN share over the windows, weighted by their seconds (absent: 0)."""
    total = sum(seconds)
    return {
        key: round(
            sum(r.get(key, 0.0) * t for r, t in zip(records, seconds, strict=True)) / total, 4
        )
        for key in BREAKDOWN
    }
