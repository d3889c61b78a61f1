"""End to end: the imagenet recipe (resnet18, 224 px, batch 32, loader.num_workers=2) reading
a folder of real JPEGs through the engine, against the compute limit of the same model on the
same threads: forward, backward and optimizer step (the engine's optimizer settings) on one
fixed in-memory batch, in the faster of NCHW and channels_last (both measured at the start,
taking turns step by step). Target: engine/bare >= 0.85 on 2 CPU cores (higher is better).

Engine: each segment is one whole epoch through the engine's own loop (train_epoch) with the
recipe's loader: decode, RandomResizedCrop and flip in 2 persistent worker processes,
prefetch 4. The folder (bench/jpegs.py) holds exactly one epoch of training images, so an
epoch ends with the loader drained and no worker decodes ahead while the bare model is timed.
The first steps of every epoch are warm-up and excluded (the workers' start in the first
epoch, the pipeline refilling after an epoch boundary). Epochs are short and several, so
that a burst of load from elsewhere spoils one pair rather than the median.

Bare: segments of a few steps before, between and after the engine epochs; each engine epoch
is compared with the mean of the bare segments either side of it, and the ratio is the median
of those. Data wait is the engine's own metric: each metrics record's data_wait (the fraction
of the window spent waiting for the loader), with log.every_steps=1 so that the measured
steps can be picked out, averaged over them weighted by their time."""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import (
    engine_epoch,
    engine_run,
    paired_ratio,
    print_ratios,
    result,
    twin_optimizer,
)
from bench.jpegs import write_jpeg_folder

TARGET = 0.85
BATCH = 32
CLASSES = 4
LAYOUTS = {"NCHW": torch.contiguous_format, "channels_last": torch.channels_last}


@dataclass(frozen=True)
class Sizes:
    px: int  # training crop side
    warmup: int  # steps at the start of each engine epoch left out
    measured: int  # steps measured per engine epoch
    epochs: int  # engine segments
    bare_steps: int  # steps per bare segment
    probe_steps: int  # steps per layout when choosing NCHW or channels_last


FULL = Sizes(px=224, warmup=2, measured=6, epochs=5, bare_steps=2, probe_steps=3)
QUICK = Sizes(px=224, warmup=2, measured=3, epochs=2, bare_steps=1, probe_steps=2)
SMOKE = Sizes(px=64, warmup=1, measured=2, epochs=1, bare_steps=1, probe_steps=1)


def overrides(root: Path, size: Sizes) -> list[str]:
    return [
        f"data.root={root}",
        "model.arch=resnet18",
        f"data.augment.train_size={size.px}",
        f"train.batch_size={BATCH}",
        "loader.num_workers=2",
        "log.every_steps=1",
        "train.epochs=1000",
    ]


def measured_steps(clock, size: Sizes) -> tuple[float, float]:
    """(images per second, data-wait fraction) over the epoch's steps after the warm-up."""
    first, last = size.warmup, size.warmup + size.measured
    rate = size.measured * BATCH / (clock.times[last] - clock.times[first])
    window = clock.records[first:last]  # one record per step (log.every_steps=1)
    seconds = [BATCH / r["samples_per_s"] for r in window]
    waited = sum(r["data_wait"] * s for r, s in zip(window, seconds, strict=True))
    return rate, waited / sum(seconds)


def bare_step(run, recipe, layout: torch.memory_format, px: int):
    """One training step of a second instance of the model on a fixed batch, as a function."""
    model = recipe.build_model(run.cfg.model).to(memory_format=layout).train()
    optimizer = twin_optimizer(run, model)
    x = torch.randn(BATCH, 3, px, px).contiguous(memory_format=layout)
    y = torch.randint(0, run.cfg.model.num_classes, (BATCH,))
    smoothing = run.cfg.train.label_smoothing

    def step() -> None:
        F.cross_entropy(model(x), y, label_smoothing=smoothing).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bare_rate(step, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * BATCH / (time.perf_counter() - started)


def fastest_layout(run, recipe, size: Sizes) -> tuple[str, object, dict[str, float]]:
    """(name, step function, images/s of each layout): after a warm-up step each, the two
    layouts take turns step by step, so a slow spell of the machine hits both; medians."""
    steps = {name: bare_step(run, recipe, layout, size.px) for name, layout in LAYOUTS.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(size.probe_steps):
        for name, step in steps.items():
            times[name].append(BATCH / bare_rate(step, 1))
    rates = {name: BATCH / statistics.median(t) for name, t in times.items()}
    best = max(rates, key=rates.get)
    return best, steps[best], rates


def alternate(run, step, size: Sizes) -> tuple[list[float], list[float], list[float]]:
    """bare, engine, bare, ..., bare: (engine rates, their neighbours' mean bare rates, waits)."""
    bare = [bare_rate(step, size.bare_steps)]
    engine, waits = [], []
    for _ in range(size.epochs):
        rate, wait = measured_steps(engine_epoch(run), size)
        engine.append(rate)
        waits.append(wait)
        bare.append(bare_rate(step, size.bare_steps))
    sides = [(a + b) / 2 for a, b in itertools.pairwise(bare)]
    return engine, sides, waits


def measure(root: Path, size: Sizes) -> dict:
    with engine_run("imagenet", overrides(root, size)) as (run, recipe):
        layout, step, probe = fastest_layout(run, recipe, size)
        engine, bare, waits = alternate(run, step, size)
    e, b, wait = statistics.median(engine), statistics.median(bare), statistics.median(waits)
    steps = f"steps {size.warmup + 1}-{size.warmup + size.measured}"
    probed = ", ".join(f"{k} {v:.1f}" for k, v in probe.items())
    note = (
        f"engine {e:.1f} img/s over {steps} of each epoch, median of {size.epochs} (JPEG decode "
        f"+ augment in 2 workers); bare compute limit {b:.1f} img/s in {layout} (probe: "
        f"{probed}); engine data wait {100 * wait:.1f}% of its time; "
        f"{torch.get_num_threads()} threads"
    )
    row = result(
        f"end to end: imagenet resnet18 {size.px}px JPEGs",
        e,
        b,
        paired_ratio(engine, bare),
        TARGET,
        "img/s",
        note,
    )
    return row | {"data_wait": wait}


def run(quick: bool = False, smoke: bool = False) -> list[dict]:
    """smoke: the smallest sizes that still run every path (tests)."""
    size = SMOKE if smoke else QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench-jpegs-") as folder:
        per_class = (size.warmup + size.measured) * BATCH // CLASSES
        root = write_jpeg_folder(Path(folder), CLASSES, per_class, val_per_class=1)
        return [measure(root, size)]


def main() -> None:
    print_ratios(run(), TARGET)


if __name__ == "__main__":
    main()
