"""The engine as the measurements drive it: a run set up from a recipe and overrides (no W&B,
no progress bar, under the bench's scratch folder), n optimizer steps through its own loop,
its metrics records kept in memory, and its workers and lock released afterwards."""

from __future__ import annotations

import contextlib
import dataclasses
import os

from bench.gpu.harness import Bench
from engine import catalog
from engine import distributed as D
from engine.catalog import load_config
from engine.config import ENGINE_SECTIONS
from engine.train import setup, train_steps


def has_key(recipe_name: str, dotted: str) -> bool:
    """Whether this checkout's config knows `section.field` (switches land over time)."""
    section, _, name = dotted.partition(".")
    recipe = catalog.load(recipe_name)
    cls = {"model": recipe.model_config, "data": recipe.data_config}.get(section)
    cls = cls or ENGINE_SECTIONS.get(section)
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)}


class Capture:
    """The run's tracker, keeping each record in memory as well."""

    def __init__(self, tracker):
        self.tracker, self.records = tracker, []

    def write(self, record: dict) -> None:
        self.records.append(dict(record))
        self.tracker.write(record)

    def close(self) -> None:
        self.tracker.close()


def engine_run(bench: Bench, recipe: str, overrides: list[str], name: str, variant: str = ""):
    common = [
        "log.wandb=off",
        "log.progress=off",
        f"run.root={bench.tmp / 'runs'}",
        f"run.name={name}",
        f"device={bench.device.type}",
    ]
    cfg, rec = load_config(recipe, [*common, *overrides], variant)
    run = setup(cfg, rec, D.DistEnv(), bench.device)
    run.records.tracker = Capture(run.records.tracker)
    return run


def close_run(run) -> None:
    with contextlib.suppress(Exception):
        run.records.tracker.close()
    if run.records.lock_fd is not None:
        with contextlib.suppress(OSError):
            os.close(run.records.lock_fd)
        run.records.lock_fd = None
    close = getattr(run.feed.loader, "close", None)  # loader.decode_ahead's thread, first
    if close is not None:
        with contextlib.suppress(Exception):
            close()
    iterator = getattr(run.feed.loader, "_iterator", None)  # persistent loader workers
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        with contextlib.suppress(Exception):
            iterator._shutdown_workers()


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
