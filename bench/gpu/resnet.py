"""(a) resnet50_synthetic: ResNet-50, bf16 autocast, channels_last, batch 256, SGD: images/s
through the engine (its loop, sampler, loader, metering) against a bare hand-written loop on
the same model and flags, eager and torch.compile'd. The data are uint8 images resident on
the device, gathered and normalised each step (the engine's DeviceImages; the bare loop does
the same gather), so neither side waits for decoding. Timed segments alternate engine/bare;
figures are medians, the ratio the median of the pairwise ratios. Targets: >= 3500 img/s
each, engine/bare >= 0.95.

FLOPs per trained image are engine.speed.flops_per_sample's: 3x the forward FLOPs counted by
torch's FlopCounterMode (2 FLOPs per multiply-add), ResNet-50 at 224 px 4.1 G multiply-adds =
8.2 GFLOPs forward, 24.5 GFLOPs per trained image."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.gpu.compile_log import dynamo_delta, dynamo_snapshot
from bench.gpu.engine_runs import close_run, engine_run, engine_steps, last_record
from bench.gpu.harness import (
    Bench,
    attempt,
    device_peak,
    get,
    median,
    mfu,
    peak_memory_gb,
    reset_peak,
    timed,
)
from bench.gpu.sizes import TARGETS
from engine import catalog
from engine.catalog import load_config
from engine.data.loaders import train_loader
from engine.speed import flops_per_sample
from engine.vision.device import DeviceImages
from engine.vision.images import IMAGENET_MEAN, IMAGENET_STD

RESNET50_FORWARD_GMACS = 4.1  # the usual "4.1 GFLOPs" of ResNet-50 at 224 px: multiply-adds


class BareLoop:
    """What a tutorial writes: gather a batch, forward under autocast, backward, step."""

    def __init__(self, model, optimizer, data, batch: int, amp, device, layout):
        self.model, self.optimizer, self.data = model, optimizer, data
        self.batch, self.amp, self.device, self.layout = batch, amp, device, layout
        self.order = torch.randperm(len(data), device=device)
        self.cursor = 0

    def steps(self, n: int) -> None:
        for _ in range(n):
            if self.cursor + self.batch > len(self.order):
                self.order, self.cursor = torch.randperm(len(self.data), device=self.device), 0
            index = self.order[self.cursor : self.cursor + self.batch]
            self.cursor += self.batch
            x, y = self.data.batch(index)
            x = x.contiguous(memory_format=self.layout)
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def device_images(n: int, size: int, classes: int, device: torch.device) -> DeviceImages:
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (n, 3, size, size)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen, device=device)
    labels = torch.randint(0, classes, (n,), generator=gen, device=device)
    names = [f"class{c:04d}" for c in range(classes)]
    return DeviceImages(images, labels, IMAGENET_MEAN, IMAGENET_STD, classes=names)


def resnet_overrides(bench: Bench, compile_on: bool) -> list[str]:
    """The imagenet recipe at the bench's model, batch, precision and image size."""
    s = bench.sizes
    return [
        f"model.arch={s.arch}",
        f"train.batch_size={s.batch}",
        f"train.amp={s.amp}",
        "train.channels_last=true",
        f"train.compile={'on' if compile_on else 'off'}",
        "train.epochs=1000",
        "loader.num_workers=0",
        f"data.augment.train_size={s.image}",
        f"data.augment.eval_size={s.image}",
        f"data.augment.eval_resize={s.image}",
    ]


def synthetic_overrides(bench: Bench, compile_on: bool) -> list[str]:
    s = bench.sizes
    overrides = resnet_overrides(bench, compile_on)
    overrides += ["data.synthetic=true", f"data.synthetic_train={s.device_images}"]
    return overrides + [f"data.synthetic_val={s.batch}", "data.synthetic_classes=1000"]


def feed_device_images(bench: Bench, run) -> DeviceImages:
    """The engine's on-device path: no workers, no copies."""
    data = device_images(bench.sizes.device_images, bench.sizes.image, 1000, bench.device)
    run.feed.train_data = data
    run.feed.loader = train_loader(data, run.feed.sampler, run.cfg.loader, bench.device)
    return data


def bare_twin(bench: Bench, run, data: DeviceImages, compiled: bool) -> tuple[BareLoop, dict]:
    """A second model of the same architecture with the engine run's optimizer settings
    (its fused/foreach flags included), and the bare loop that trains it."""
    layout = torch.channels_last
    model = catalog.load("imagenet").build_model(run.cfg.model)
    model = model.to(bench.device, memory_format=layout)
    flags = {k: run.opt.optimizer.defaults.get(k) for k in ("fused", "foreach")}
    o = run.cfg.optim
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=run.opt.optimizer.param_groups[0]["lr"],
        momentum=o.momentum,
        nesterov=o.nesterov,
        weight_decay=o.weight_decay,
        **{k: v for k, v in flags.items() if v is not None},
    )
    if compiled:
        model = torch.compile(model)
    loop = BareLoop(
        model, optimizer, data, bench.sizes.batch, run.opt.amp_dtype, bench.device, layout
    )
    return loop, flags


def segment_steps(bench: Bench, step_s: float, name: str) -> int:
    """Steps that fill one timed segment (half of one when the budget is tight)."""
    lo, hi = bench.sizes.segment_steps
    aim = bench.sizes.segment_s / (2 if bench.tight(name) else 1)
    return int(min(hi, max(lo, round(aim / max(step_s, 1e-6)))))


def warm_up(bench: Bench, run, bare: BareLoop) -> dict:
    """The first (compiling) step of each path, the warm-up steps, and the segment length."""
    out = {
        "engine_first_step_s": round(timed(bench, lambda: engine_steps(run, 1)), 2),
        "bare_first_step_s": round(timed(bench, lambda: bare.steps(1)), 2),
    }
    engine_steps(run, bench.sizes.warmup_steps)
    bare.steps(bench.sizes.warmup_steps)
    step_s = timed(bench, lambda: engine_steps(run, 2)) / 2
    out["segment_steps"] = segment_steps(bench, step_s, "resnet50_synthetic")
    out["budget_tight"] = bench.tight("resnet50_synthetic")
    return out


def timed_segment(bench: Bench, steps_of, steps: int) -> tuple[float, float | None]:
    """img/s of `steps` steps and their memory high-water mark."""
    reset_peak(bench.device)
    rate = steps * bench.sizes.batch / timed(bench, lambda: steps_of(steps))
    return rate, peak_memory_gb(bench.device)


def alternate_segments(bench: Bench, run, bare: BareLoop, steps: int, out: dict) -> dict:
    """Engine and bare segments in turn: per path, its img/s and memory high-water marks.
    Stops after two pairs when what is left of the budget is short for (b) onwards."""
    paths = {"engine": lambda n: engine_steps(run, n), "bare": bare.steps}
    figures = {name: ([], []) for name in paths}
    for k in range(bench.sizes.segments):
        for name, steps_of in paths.items():
            rate, peak = timed_segment(bench, steps_of, steps)
            figures[name][0].append(rate)
            figures[name][1].append(peak)
        if k >= 1 and bench.remaining() < 0.5 * bench.planned_rest("imagenet_jpeg"):
            out["note"] = f"stopped after {k + 1} segments: the budget is short"
            break
    return figures


def resnet_pair(bench: Bench, compiled: bool, flops: float, peak: float) -> dict:
    """Engine and bare loop on one model each, timed in alternating segments."""
    name = f"a-{'compiled' if compiled else 'eager'}"
    run = engine_run(bench, "imagenet", synthetic_overrides(bench, compiled), name)
    try:
        bare, flags = bare_twin(bench, run, feed_device_images(bench, run), compiled)
        out = {
            "optimizer_flags": flags,
            "engine_amp": str(run.opt.amp_dtype),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,  # the engine's set-up sets
            "float32_matmul_precision": torch.get_float32_matmul_precision(),  # both globally
        }
        out |= warm_up(bench, run, bare)
        before = dynamo_snapshot()
        figures = alternate_segments(bench, run, bare, out["segment_steps"], out)
        after = dynamo_delta(before, dynamo_snapshot())
        (engine, engine_mem), (plain, bare_mem) = figures["engine"], figures["bare"]
        ratios = [e / b for e, b in zip(engine, plain, strict=True)]
        out["engine"] = path_figures(engine, engine_mem, flops, peak)
        out["bare"] = path_figures(plain, bare_mem, flops, peak)
        out["engine_over_bare"] = round(median(ratios), 4)
        out["engine_metrics_record"] = last_record(run)
        if compiled:
            out["compile_during_timed_segments"] = after or "none (no recompilation)"
            out["compile_note"] = (
                "both paths compile the same forward code; where dynamo's guards pass, the "
                "second model runs on the first one's graph (frames_compiled counts them)"
            )
        return out
    finally:
        close_run(run)


def path_figures(rates: list[float], memory: list, flops: float, peak: float) -> dict:
    rate = median(rates)
    out = {"img_per_s": round(rate, 1), "segments_img_per_s": [round(r, 1) for r in rates]}
    if any(m is not None for m in memory):
        out["peak_memory_gb"] = max(m for m in memory if m is not None)
    out["mfu"] = mfu(rate, flops, peak)
    return out


def train_flops(bench: Bench) -> float:
    """engine.speed's training FLOPs per image of (a)'s model at the bench's image size."""
    s = bench.sizes
    overrides = [f"model.arch={s.arch}", "model.num_classes=1000"]
    cfg, recipe = load_config("imagenet", [*overrides, f"data.augment.train_size={s.image}"])
    return flops_per_sample(recipe, cfg)


def resnet50_synthetic(bench: Bench) -> dict:
    s = bench.sizes
    flops = train_flops(bench)
    peak, peak_source = device_peak(bench.device)
    out = bench.entry("resnet50_synthetic")  # in the JSON from the start, the parts with it
    out |= {
        "model": s.arch,
        "batch": s.batch,
        "image": s.image,
        "amp": s.amp,
        "channels_last": True,
        "data": "uint8 images resident on the device, gathered and normalised each step",
        "train_gflops_per_img": round(flops / 1e9, 3),
        "flops_note": "3x forward FLOPs counted by FlopCounterMode (2 FLOPs per multiply-add); "
        f"ResNet-50's usual '{RESNET50_FORWARD_GMACS} GFLOPs' are multiply-adds",
        "peak": peak_source,
        "memory_note": "peak_memory_gb of a path: the high-water mark during its timed "
        "segments, with both models, their optimizer states and the device images resident",
        "targets": {k: TARGETS[k] for k in ("resnet50_img_per_s", "engine_over_bare")},
    }
    out["eager"] = attempt(
        bench,
        "resnet50_synthetic.eager",
        "(a) eager",
        lambda: resnet_pair(bench, False, flops, peak),
        need_s=bench.need(20),
    )
    out["compiled"] = attempt(
        bench,
        "resnet50_synthetic.compiled",
        "(a) torch.compile",
        lambda: resnet_pair(bench, True, flops, peak),
        need_s=bench.need(100),
    )
    ok = [m for m in ("compiled", "eager") if out[m]["status"] == "ok"]
    if not ok:
        return out | {"status": "error", "error": "neither pair ran (see eager and compiled)"}
    bench.cache["synthetic"] = {m: out[m]["engine"]["img_per_s"] for m in ok}
    out["headline"] = headline(out[ok[0]], ok[0])
    return out


def headline(best: dict, mode: str) -> dict:
    """The figures of the faster mode that ran (compiled when it did), against the targets."""
    engine, bare = best["engine"]["img_per_s"], best["bare"]["img_per_s"]
    return {
        "mode": mode,
        "engine_img_per_s": engine,
        "bare_img_per_s": bare,
        "engine_over_bare": best["engine_over_bare"],
        "meets_3500": min(engine, bare) >= 3500,
        "meets_ratio_0.95": best["engine_over_bare"] >= 0.95,
    }


def summary(entry: dict) -> list[str]:
    """Engine and bare img/s and their ratio for each mode, or why a mode has none."""
    model, lines = entry.get("model", "resnet"), []
    for mode in ("eager", "compiled"):
        e, b = get(entry, mode, "engine", "img_per_s"), get(entry, mode, "bare", "img_per_s")
        if e is not None:
            ratio = get(entry, mode, "engine_over_bare")
            lines.append(
                f"  (a) {model} {mode:8s} engine {e:8.1f} img/s, bare {b:8.1f} img/s "
                f"(target >= 3500); engine/bare {ratio:.3f} (target >= 0.95)"
            )
        elif isinstance(entry.get(mode), dict):
            part = entry[mode]
            why = part.get("reason") or part.get("error", "")
            lines.append(f"  (a) {mode}: {part.get('status')} {why[:200]}".rstrip())
    return lines
