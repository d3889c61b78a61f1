"""Pieces the benchmarks share: the result record, paired medians, an engine run in a
temporary folder, a clock the engine's loop drives, and a bare twin of the engine's model
and optimizer for the hand-written baselines."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from engine import distributed as D
from engine.assemble import setup
from engine.catalog import load_config
from engine.recipe import Recipe
from engine.run import Run
from engine.train import train_steps

CPU = torch.device("cpu")


def result(
    name: str,
    measured: float,
    baseline: float | None,
    ratio: float,
    target: float | None,
    unit: str,
    note: str,
) -> dict:
    """One row of the report; ratio reads "higher is better", target is its threshold."""
    return {
        "name": name,
        "measured": measured,
        "baseline": baseline,
        "ratio": ratio,
        "target": target,
        "unit": unit,
        "note": note,
    }


def print_ratios(rows: list[dict], target: float) -> None:
    """A module's results on their own (`python -m bench.<module>`)."""
    for row in rows:
        print(
            f"{row['name']}: engine/bare = {row['ratio']:.3f} (target >= {target}); {row['note']}"
        )


def paired_ratio(measured: list[float], baseline: list[float]) -> float:
    """Median of the ratios of segments measured side by side: a burst of load on a shared
    machine spoils one pair, not the result, which a ratio of means would not survive."""
    return statistics.median(m / b for m, b in zip(measured, baseline, strict=True))


class Capture:
    """The run's tracker, keeping each record in memory as well."""

    def __init__(self, tracker):
        self.tracker, self.records = tracker, []

    def write(self, record: dict) -> None:
        self.records.append(dict(record))
        self.tracker.write(record)

    def close(self) -> None:
        self.tracker.close()


def start_engine_run(
    recipe: str,
    overrides: list[str],
    root: Path,
    name: str = "bench",
    device: torch.device = CPU,
    variant: str = "",
    replace: Callable[[Recipe], Recipe] | None = None,
) -> tuple[Run, Recipe]:
    """The engine's Run (and the recipe) for one process, set up as `make train` sets it up
    (no W&B, no progress display), under `root`, its metrics records also kept in memory
    (run.records.tracker.records). `replace`: a recipe built from the named one, run in its
    place. The one way every benchmark, CPU or GPU, builds an engine run."""
    fixed = ["log.wandb=off", "log.progress=off", f"run.root={root}", f"run.name={name}"]
    cfg, rec = load_config(recipe, [*fixed, f"device={device.type}", *overrides], variant)
    rec = replace(rec) if replace else rec
    run = setup(cfg, rec, D.DistEnv(), device)
    run.records.tracker = Capture(run.records.tracker)
    return run, rec


def close_engine_run(run: Run) -> None:
    """The tracker, the lock on the run directory, the thread finishing batches ahead and
    the loader's persistent workers, released; never raises (a benchmark reports, then ends)."""
    with contextlib.suppress(Exception):
        run.records.tracker.close()
    if run.held.lock_fd is not None:
        with contextlib.suppress(OSError):
            os.close(run.held.lock_fd)
        run.held.lock_fd = None
    close = getattr(run.feed.loader, "close", None)  # loader.decode_ahead's thread, first
    if close is not None:
        with contextlib.suppress(Exception):
            close()
    iterator = getattr(run.feed.loader, "_iterator", None)  # persistent loader workers
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        with contextlib.suppress(Exception):
            iterator._shutdown_workers()


@contextlib.contextmanager
def engine_run(
    recipe: str, overrides: list[str], replace: Callable[[Recipe], Recipe] | None = None
) -> Iterator[tuple[Run, Recipe]]:
    """start_engine_run on the CPU in a temporary folder, closed and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench-") as root:
        run, rec = start_engine_run(recipe, overrides, Path(root), replace=replace)
        try:
            yield run, rec
        finally:
            close_engine_run(run)
            del run
            gc.collect()  # the loader's workers end before the folder goes


class StepClock:
    """Stands in for the engine's progress display, which the loop calls after every
    optimizer step: the time of each step is read there, and nothing is added to the loop."""

    def __init__(self):
        self.times = [time.perf_counter()]
        self.records: list[dict] = []

    def update(self, step: int, record: dict | None) -> None:
        self.times.append(time.perf_counter())
        if record:
            self.records.append(record)

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def engine_epoch(run: Run) -> StepClock:
    """One whole epoch through the engine's own loop (train_steps); the clock holds its
    step times and metric records."""
    clock = StepClock()
    train_steps(run, run.feed.sampler.steps_per_epoch, clock)  # from an epoch's start
    return clock


def memory_format_of(model: nn.Module) -> torch.memory_format:
    """The layout of the model's convolution weights (the engine picks it): a 4-d weight with
    several input channels and a kernel wider than 1x1 tells channels_last from NCHW."""
    for p in model.parameters():
        if p.ndim == 4 and p.shape[1] > 1 and p.shape[2] * p.shape[3] > 1:
            return torch.contiguous_format if p.is_contiguous() else torch.channels_last
    return torch.contiguous_format


def twin_optimizer(run: Run, model: nn.Module) -> torch.optim.Optimizer:
    """The engine's optimizer, same class, parameter groups, hyperparameters and fused or
    foreach implementation, on `model` (a second instance of the same architecture)."""
    twin = dict(zip((id(p) for p in run.net.bare.parameters()), model.parameters(), strict=True))
    groups = []
    for group in run.opt.optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
        settings["lr"] = group.get("initial_lr", group["lr"])
        groups.append(settings | {"params": [twin[id(p)] for p in group["params"]]})
    return type(run.opt.optimizer)(groups, **run.opt.optimizer.defaults)


def twin_model(run: Run, recipe: Recipe) -> nn.Module:
    """A second instance of the engine's model (same config), in the engine's layout."""
    model = recipe.build_model(run.cfg.model)
    return model.to(memory_format=memory_format_of(run.net.bare)).train()


def twin_schedule(run: Run, optimizer: torch.optim.Optimizer):
    """The engine's learning-rate schedule (the same function of the step) on `optimizer`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, run.opt.scheduler.lr_lambdas[0])
