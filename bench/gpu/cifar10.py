"""(c) cifar10_fast: the CIFAR-10 fast variant (airbench-style, data on the device). Part
`generated`, on generated data of the real shape (50k train, 10k test, 32x32): seconds per
epoch and the projected time of its 475-step (9.9-epoch) budget. Accuracy (94% is the aim)
can only be measured on the real CIFAR-10: part `real_data`, when its files are at the
recipe's data.root, measures the run to the end and its final top-1.

Part `airbench94`, side by side on the same generated data: airbench's own code (the
airbench==0.1.8 package, installed by bench/gpu.sh from .gpu-wheels/; no copy in this repo),
its train94() in a folder holding the data as its CifarLoader reads it (cifar10/train.pt and
test.pt), after its own warm-up (warmup94). Its own timing (CUDA events: the whitening
set-up, the training epochs and the final test-time-augmented evaluation, what its 3.83 s on
an A100 counts) as it prints it, the training alone, time per step, and this process's wall
time of the call (data loading and its per-epoch evaluations included), beside the engine's
projected time for the same 475 steps from part `generated`. airbench needs CUDA (it calls
.cuda() and .half()): skipped on a CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import time
from pathlib import Path

import torch

from bench.gpu.engine_runs import close_run, engine_run, engine_steps
from bench.gpu.harness import REPO, Bench, Skip, attempt, device_peak, fmt, median, mfu, timed
from bench.gpu.sizes import REFERENCES
from engine import catalog
from engine.catalog import data_here, load_config
from engine.speed import flops_per_sample
from engine.tracking import ProgressBar
from engine.train import fit, run_eval
from recipes.cifar10 import cifar_files

AIRBENCH_PIN = "airbench==0.1.8"


def cifar_folder(bench: Bench) -> Path:
    """Generated CIFAR-10 of the real shape in the official python-batch format."""
    if "cifar" in bench.cache:
        return bench.cache["cifar"]
    spec = importlib.util.spec_from_file_location(
        "datagen_cifar", REPO / "tests" / "datagen_cifar.py"
    )
    datagen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(datagen)
    root = datagen.write_cifar_batches(
        bench.tmp / "cifar10", bench.sizes.cifar_train, bench.sizes.cifar_test, python2=False
    )
    bench.cache["cifar"] = root
    return root


def epoch_times(bench: Bench, run) -> dict:
    """Seconds of the first (compiling) epoch, of each timed epoch after it, and of the first
    and second evaluation passes."""
    spe = run.feed.sampler.steps_per_epoch
    out = {"first_epoch_s": round(timed(bench, lambda: engine_steps(run, spe)), 3)}
    epochs = 1 if bench.tight("cifar10_fast") else bench.sizes.cifar_epochs
    out["epochs_s"] = [timed(bench, lambda: engine_steps(run, spe)) for _ in range(epochs)]
    progress = ProgressBar(1, run.progress.step, "off", False)
    out["eval_first_s"] = timed(bench, lambda: run_eval(run, progress))
    out["eval_s"] = timed(bench, lambda: run_eval(run, progress))
    return out


def projections(bench: Bench, run, t: dict) -> dict:
    """Epoch time and what it projects for the variant's step budget; throughput and MFU."""
    spe, batch = run.feed.sampler.steps_per_epoch, run.cfg.train.batch_size
    budget_steps = run.cfg.train.max_steps
    epoch_s = median(t["epochs_s"])
    flops = flops_per_sample(catalog.load("cifar10"), run.cfg)
    peak, _ = device_peak(bench.device)
    return {
        "epoch_s": round(epoch_s, 4),
        "epochs_s": [round(e, 4) for e in t["epochs_s"]],
        "budget_tight": len(t["epochs_s"]) < bench.sizes.cifar_epochs,
        "step_ms": round(1000 * epoch_s / spe, 3),
        "projected_budget_s": round(budget_steps * epoch_s / spe, 3),
        "eval_first_s": round(t["eval_first_s"], 3),
        "eval_s": round(t["eval_s"], 3),
        "projected_budget_with_final_eval_s": round(budget_steps * epoch_s / spe + t["eval_s"], 3),
        # what a fresh process takes: the first epoch and evaluation compile
        "projected_cold_start_s": round(
            t["first_epoch_s"] + (budget_steps - spe) * epoch_s / spe + t["eval_first_s"], 3
        ),
        "img_per_s": round(spe * batch / epoch_s, 1),
        "train_mflops_per_img": round(flops / 1e6, 2),
        "mfu": mfu(spe * batch / epoch_s, flops, peak),
        "reference": REFERENCES[2],
    }


def cifar10_fast(bench: Bench) -> dict:
    """The two parts, each filed as soon as it ends; an error when one failed and none ran."""
    parts = [
        attempt(
            bench,
            "cifar10_fast.generated",
            "(c) generated CIFAR-10",
            lambda: cifar_generated(bench),
            need_s=bench.need(20),
        ),
        attempt(
            bench,
            "cifar10_fast.airbench94",
            "(c) airbench94 on the same data",
            lambda: airbench94(bench),
            need_s=bench.need(12),
        ),
        attempt(
            bench,
            "cifar10_fast.real_data",
            "(c) real CIFAR-10",
            lambda: cifar_real(bench),
            need_s=bench.need(60),
        ),
    ]
    statuses = {part["status"] for part in parts}
    if "error" in statuses and "ok" not in statuses:
        return {"status": "error", "error": "no part ran (see generated and real_data)"}
    return {}


def cifar_generated(bench: Bench) -> dict:
    s = bench.sizes
    started = time.perf_counter()
    root = cifar_folder(bench)
    out = {
        "data": f"generated, the real shape: {s.cifar_train} train / {s.cifar_test} test, "
        "3x32x32 uint8 (class colour + noise)",
        "accuracy_note": "time only: reaching 94% top-1 can be measured only on the real "
        "CIFAR-10 (see real_data)",
        "data_generation_s": round(time.perf_counter() - started, 1),
    }
    started = time.perf_counter()
    run = engine_run(
        bench, "cifar10", [f"data.root={root}", *s.cifar_overrides], "c-fast", variant="fast"
    )
    try:
        out["setup_s"] = round(time.perf_counter() - started, 2)  # data to device, whitening
        spe, budget_steps = run.feed.sampler.steps_per_epoch, run.cfg.train.max_steps
        out |= {"batch": run.cfg.train.batch_size, "steps_per_epoch": spe}
        out |= {"budget_steps": budget_steps, "budget_epochs": round(budget_steps / spe, 2)}
        t = epoch_times(bench, run)
        out["first_epoch_s"] = t["first_epoch_s"]
        out |= projections(bench, run, t)
    finally:
        close_run(run)
    return out


def import_airbench(bench: Bench):
    """airbench, or Skip with the reason (no CUDA, or not installed)."""
    if bench.device.type != "cuda":
        raise Skip("airbench needs CUDA: it calls .cuda() and .half()")
    try:
        import airbench  # optional: carried to the GPU machine as a wheel (make gpu-wheels)
    except ImportError as err:
        raise Skip(
            f"airbench cannot be imported ({err}): make gpu-wheels puts {AIRBENCH_PIN} in "
            ".gpu-wheels/, which bench/gpu.sh installs"
        ) from None
    return airbench


def airbench_files(bench: Bench) -> Path:
    """The generated CIFAR-10 as airbench's CifarLoader reads it: <dir>/cifar10/{train,test}.pt
    ({'images': uint8 NHWC, 'labels': int64, 'classes': names}); returns <dir>."""
    root = cifar_folder(bench)
    folder = bench.tmp / "airbench"
    (folder / "cifar10").mkdir(parents=True, exist_ok=True)
    classes = cifar_files.read_classes(root)
    for split, train in (("train", True), ("test", False)):
        images, labels = cifar_files.read_split(root, train)
        data = {"images": images.permute(0, 2, 3, 1).contiguous(), "labels": labels}
        torch.save(data | {"classes": classes}, folder / "cifar10" / f"{split}.pt")
    return folder


def airbench_rows(printed: str) -> list[dict]:
    """The rows of the table airbench prints (run, epoch, ..., total_time_seconds)."""
    lines = [line.strip() for line in printed.splitlines() if line.strip().startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    if not cells:
        raise RuntimeError(f"airbench printed no table: {printed[-500:]!r}")
    head, *rows = cells
    return [dict(zip(head, row, strict=True)) for row in rows]


def airbench_figures(rows: list[dict], steps: int) -> dict:
    """Its own total (the final 'eval' row), the training alone (the last epoch row) and per
    step."""
    final = next(r for r in rows if r["epoch"] == "eval")
    epochs = [r for r in rows if r["epoch"] not in ("", "eval")]
    train_s = float(epochs[-1]["total_time_seconds"])
    return {
        "airbench_total_s": float(final["total_time_seconds"]),
        "train_s": round(train_s, 4),
        "step_ms": round(1000 * train_s / steps, 3),
        "tta_val_acc": float(final["tta_val_acc"]),
    }


def airbench94(bench: Bench) -> dict:
    airbench = import_airbench(bench)
    from airbench import lib_airbench94  # optional: as above, imported once airbench is

    folder = airbench_files(bench)
    opt = lib_airbench94.hyp["opt"]
    steps = math.ceil(bench.sizes.cifar_train // opt["batch_size"] * opt["train_epochs"])
    printed = io.StringIO()
    with contextlib.chdir(folder):
        with contextlib.redirect_stdout(io.StringIO()):  # its warm-up prints one row, headless
            warm = timed(bench, lambda: airbench.warmup94(verbose=True))
        with contextlib.redirect_stdout(printed):
            wall = timed(bench, lambda: airbench.train94(verbose=True))
    out = {"package": AIRBENCH_PIN, "steps": steps, "warmup_s": round(warm, 2)}
    out |= airbench_figures(airbench_rows(printed.getvalue()), steps)
    out["wall_s"] = round(wall, 2)
    out["accuracy_note"] = "tta_val_acc on generated data: not CIFAR-10's accuracy"
    engine = bench.result["measurements"].get("cifar10_fast", {}).get("generated", {})
    if engine.get("status") == "ok":
        out["engine_projected_budget_s"] = engine["projected_budget_s"]
        out["engine_over_airbench_train"] = round(engine["projected_budget_s"] / out["train_s"], 3)
    return out


def cifar_real(bench: Bench) -> dict:
    cfg, _ = load_config("cifar10", [], "fast")
    try:
        cifar_files.require(Path(data_here(cfg).root))
    except Exception:
        raise Skip(
            "no CIFAR-10 files at the recipe's data.root ($RECIPES_DATA/cifar10 or "
            "data/cifar10): time to the end and top-1 not measured"
        ) from None
    overrides = [*bench.sizes.cifar_overrides, *bench.sizes.cifar_real_overrides]
    started = time.perf_counter()
    run = engine_run(bench, "cifar10", overrides, "c-fast-real", variant="fast")
    try:
        setup_s = time.perf_counter() - started
        bench.sync()
        seconds = timed(bench, lambda: fit(run))
        last = run.records.last_eval
        return {
            "data": "the files at the recipe's data.root",
            "setup_s": round(setup_s, 2),
            "fit_s": round(seconds, 2),
            "fit_note": "the engine's fit(): training, an evaluation and a checkpoint after "
            "every epoch, the first compilation included",
            "steps": run.progress.step,
            "top1": last.get("top1"),
            "top5": last.get("top5"),
        }
    finally:
        close_run(run)


def summary(entry: dict) -> list[str]:
    lines = []
    generated, real = entry.get("generated", {}), entry.get("real_data", {})
    if generated.get("status") == "ok":
        lines.append(
            f"  (c) CIFAR-10 fast: {generated['epoch_s']:.3f} s/epoch, projected "
            f"{generated['projected_budget_s']:.2f} s for {generated['budget_steps']} steps "
            "(airbench94: 3.83 s on an A100)"
        )
    elif generated:
        why = generated.get("reason") or generated.get("error", "")
        lines.append(f"  (c) CIFAR-10 fast: {generated.get('status')} {why[:200]}".rstrip())
    lines += airbench_summary(entry.get("airbench94", {}))
    if real.get("status") == "ok":
        lines.append(
            f"  (c) CIFAR-10 fast on the real files: top-1 {fmt(real['top1'], '.4f')} after "
            f"{real['steps']} steps in {real['fit_s']:.1f} s (airbench94: 94.01% in 3.83 s)"
        )
    return lines


def airbench_summary(air: dict) -> list[str]:
    if air.get("status") == "ok":
        return [
            f"  (c) airbench94 on the same data: {air['train_s']:.2f} s training "
            f"({air['step_ms']:.2f} ms/step), {air['airbench_total_s']:.2f} s by its own count"
        ]
    if air:
        return [f"  (c) airbench94: {air.get('status')} {air.get('reason', '')}".rstrip()]
    return []
