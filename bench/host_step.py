"""The engine's own host time per optimizer step: what the loop adds on the host to each
step, which bounds small models on a fast device (CIFAR-10 fast: a few ms a step on a GPU).

The model is one Linear layer on 16 features (10 classes), so the compute is negligible and
what remains is per-step work: the engine's loop (loader hand-off, sampler keys, seeding,
batch records, gradient norm, non-finite check, metering, logging every log.every_steps,
EMA off, the preemption check, bookkeeping) against a bare loop with the same model, data
(an in-memory TensorDataset), optimizer (the engine's: class, groups, fused/foreach),
schedule and batch (512). The bare loop indexes the tensors with a slice of a fresh
permutation per epoch: the least any loop over in-memory data does.

host µs/step = (engine s/step - bare s/step) x 1e6, both the medians of segments (whole
epochs) measured in the same run in pairs, engine then bare, then bare then engine, after
one warm-up epoch of each, with one intra-op thread (kernels this small gain nothing from
more, and waking them is noise). Target: at most 180 µs (ratio = 180 / measured, >= 1 passes),
on the AVX512 2-core machine whose figures bench/README.md gives; slower machines read more."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from bench.common import (
    engine_epoch,
    engine_run,
    result,
    twin_model,
    twin_optimizer,
    twin_schedule,
)

TARGET_US = 180.0
FEATURES, CLASSES, BATCH = 16, 10, 512


@dataclasses.dataclass(frozen=True)
class Sizes:
    pairs: int
    steps: int  # optimizer steps per epoch (= per segment)


FULL = Sizes(pairs=41, steps=40)
QUICK = Sizes(pairs=11, steps=20)
SMOKE = Sizes(pairs=1, steps=2)


def tiny_model(cfg=None) -> nn.Module:
    return nn.Linear(FEATURES, CLASSES)


def tensor_data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=gen)
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=gen))


def tiny_recipe(recipe, n: int):
    """The digits recipe's config sections with a Linear model and in-memory tensors."""
    data = tensor_data(n)
    return dataclasses.replace(
        recipe,
        build_model=tiny_model,
        build_datasets=lambda cfg: (data, data),
        prepare=None,
        sample_shape=lambda cfg: (FEATURES,),
    )


def engine_seconds(run) -> float:
    """Seconds per optimizer step of one epoch through the engine's loop."""
    clock = engine_epoch(run)
    return (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)


def bare_seconds(model, optimizer, schedule, data: TensorDataset, batch: int) -> float:
    """Seconds per optimizer step of one epoch of the bare loop."""
    x_all, y_all = data.tensors
    steps = len(x_all) // batch
    started = time.perf_counter()
    perm = torch.randperm(len(x_all))
    for k in range(steps):
        idx = perm[k * batch : (k + 1) * batch]
        loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    return (time.perf_counter() - started) / steps


def measure(size: Sizes) -> dict:
    n = BATCH * size.steps
    overrides = ["train.epochs=100000", f"train.batch_size={BATCH}", "data.shift=0"]
    with engine_run("digits", overrides, lambda digits: tiny_recipe(digits, n)) as (run, rec):
        model = twin_model(run, rec)
        optimizer = twin_optimizer(run, model)
        schedule = twin_schedule(run, optimizer)
        data = run.feed.train_data

        def bare() -> float:
            return bare_seconds(model, optimizer, schedule, data, BATCH)

        engine_seconds(run)  # warm-up
        bare()
        engine, baseline = [], []
        for i in range(size.pairs):
            if i % 2:
                baseline.append(bare())
            engine.append(engine_seconds(run))
            if not i % 2:
                baseline.append(bare())
        every = run.cfg.log.every_steps
    e, b = statistics.median(engine), statistics.median(baseline)
    host_us = max((e - b) * 1e6, 1e-3)
    note = (
        f"(engine - bare) s/step x 1e6, medians of {size.pairs} paired epochs of "
        f"{size.steps} steps; engine {e * 1e6:.0f} us/step, bare {b * 1e6:.0f} us/step; "
        f"Linear({FEATURES}, {CLASSES}), batch {BATCH}, log every {every} steps, "
        f"{torch.get_num_threads()} threads; ratio = {TARGET_US:g} us / measured"
    )
    name = f"host time per step: Linear, batch {BATCH}"
    return result(name, host_us, TARGET_US, TARGET_US / host_us, 1.0, "us/step", note)


def run(quick: bool = False, smoke: bool = False) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no intra-op threads to wake for kernels this small: less noise
    try:
        return [measure(SMOKE if smoke else QUICK if quick else FULL)]
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    for row in run():
        print(
            f"{row['name']}: {row['measured']:.0f} us/step (target <= {TARGET_US:g}); {row['note']}"
        )


if __name__ == "__main__":
    main()
