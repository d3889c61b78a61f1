"""Engine overhead: training through the engine against a bare hand-written loop on the same
in-memory data, measured in the same run. Target: engine/bare >= 0.97 (higher is better;
above 1 the engine is faster, e.g. by a faster default).

(a) digits: the recipe's config (batch 64). (b) resnet18: the imagenet recipe with
model.arch=resnet18 on its synthetic images (uint8 drawn per sample from torch's RNG, no
disk, 10 classes), 64 px so that enough segments fit the time budget, batch 32, loader in
the main process.

Both sides run in this process with the same threads, the same Dataset object, the same model
config, the engine's memory format (read off its weights), the engine's optimizer (class,
parameter groups, hyperparameters, fused/foreach) and its learning-rate schedule. The bare
loop is what a tutorial writes for in-memory data: a DataLoader(shuffle=True, drop_last=True)
over the dataset with the default collate; per batch: the dataset's own on-device finishing
when it has one (uint8 to normalised float), the layout, forward, cross-entropy, backward,
optimizer step, zero_grad(set_to_none=True), schedule step. Only the engine does: per-sample
seeding (and the RNG restore per batch), Sample records (index, replaced flag), the gradient
norm and non-finite check, loss metering, a metrics record every log.every_steps, the
preemption check, the step and position bookkeeping.

Segments are whole epochs in pairs, engine then bare, then bare then engine, and so on,
after one warm-up epoch of each. measured and baseline are the medians of samples per
second; the ratio is the median of the pairwise ratios (so not exactly measured / baseline).
Two bare loops measured this way read 0.995-1.016 here: differences of a percent or two are
this machine's noise."""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from bench.common import (
    engine_epoch,
    engine_run,
    memory_format_of,
    paired_ratio,
    print_ratios,
    result,
    twin_model,
    twin_optimizer,
    twin_schedule,
)

TARGET = 0.97


@dataclass(frozen=True)
class Sizes:
    digits_pairs: int
    resnet_pairs: int
    resnet_px: int  # image side of the synthetic images
    resnet_steps: int  # optimizer steps per epoch (= per segment)


FULL = Sizes(digits_pairs=81, resnet_pairs=16, resnet_px=64, resnet_steps=5)
QUICK = Sizes(digits_pairs=15, resnet_pairs=5, resnet_px=64, resnet_steps=3)
SMOKE = Sizes(digits_pairs=2, resnet_pairs=1, resnet_px=64, resnet_steps=2)


def engine_rate(run) -> float:
    """Samples per second of one epoch through the engine's own loop."""
    before = run.progress.step
    clock = engine_epoch(run)
    samples = (run.progress.step - before) * run.feed.sampler.plan.global_batch
    return samples / (clock.times[-1] - clock.times[0])


def bare_epoch(model, optimizer, schedule, loader, finish, smoothing: float) -> float:
    """Samples per second of one epoch of the hand-written loop."""
    layout = memory_format_of(model)
    samples, started = 0, time.perf_counter()
    for x, y in loader:
        x = finish(x).contiguous(memory_format=layout)
        loss = F.cross_entropy(model(x), y, label_smoothing=smoothing)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        samples += len(y)
    return samples / (time.perf_counter() - started)


def bare_loop(run, recipe):
    """The bare side as a function of nothing: one call, one epoch."""
    model = twin_model(run, recipe)
    optimizer = twin_optimizer(run, model)
    data = run.feed.train_data
    loader = DataLoader(data, batch_size=run.cfg.train.batch_size, shuffle=True, drop_last=True)
    finish = getattr(data, "finish_on_device", None)
    finish = functools.partial(finish, device=run.device) if finish else (lambda x: x)
    schedule = twin_schedule(run, optimizer)
    smoothing = run.cfg.train.label_smoothing
    return functools.partial(bare_epoch, model, optimizer, schedule, loader, finish, smoothing)


def paired_epochs(run, recipe, pairs: int) -> tuple[list[float], list[float]]:
    bare = bare_loop(run, recipe)
    engine_rate(run)  # warm-up: allocator, the kernels' first calls, page faults
    bare()
    engine, baseline = [], []
    for i in range(pairs):  # engine first, then bare first: neither gains from going first
        if i % 2:
            baseline.append(bare())
        engine.append(engine_rate(run))
        if not i % 2:
            baseline.append(bare())
    return engine, baseline


def describe(run) -> str:
    defaults = run.opt.optimizer.defaults
    impl = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "loop"
    layout = "channels_last" if memory_format_of(run.net.bare) == torch.channels_last else "NCHW"
    return f"{torch.get_num_threads()} threads, {layout}, {type(run.opt.optimizer).__name__} {impl}"


def measure(name: str, recipe_name: str, overrides: list[str], pairs: int) -> dict:
    with engine_run(recipe_name, ["train.epochs=1000", *overrides]) as (run, recipe):
        engine, bare = paired_epochs(run, recipe, pairs)
        how = describe(run)
    e, b = statistics.median(engine), statistics.median(bare)
    note = (
        f"median of {pairs} paired epochs (engine and bare loop first in turns); medians "
        f"engine {e:.0f}, bare {b:.0f} samples/s; {how}"
    )
    return result(name, e, b, paired_ratio(engine, bare), TARGET, "samples/s", note)


def resnet_overrides(size: Sizes) -> list[str]:
    px = size.resnet_px
    return [
        "model.arch=resnet18",
        "data.synthetic=true",
        f"data.synthetic_train={32 * size.resnet_steps}",
        "data.synthetic_val=32",
        "data.synthetic_classes=10",
        f"data.augment.train_size={px}",
        f"data.augment.eval_size={px}",
        "train.batch_size=32",
        "loader.num_workers=0",
    ]


def run(quick: bool = False, smoke: bool = False) -> list[dict]:
    """smoke: the smallest sizes that still run every path (tests)."""
    size = SMOKE if smoke else QUICK if quick else FULL
    digits = measure("overhead: digits", "digits", [], size.digits_pairs)
    resnet = measure(
        f"overhead: resnet18 {size.resnet_px}px synthetic",
        "imagenet",
        resnet_overrides(size),
        size.resnet_pairs,
    )
    return [digits, resnet]


def main() -> None:
    print_ratios(run(), TARGET)


if __name__ == "__main__":
    main()
