"""(b) imagenet_jpeg: (a)'s engine run fed from a folder of real ImageNet-sized JPEGs
(bench/jpegs.py: 20,480 distinct training files and 2,048 for evaluation, generated in
parallel, generation_s recorded), decoded on the CPU by loader.num_workers = cores - 1, and
with data.decode=gpu (nvJPEG): images/s, where each window's time went (the engine's
breakdown: data_wait, to_device, step_host, sync, decode, augment, finish_thread,
gpu_data_wait, as shares of the timed windows' wall time), the ratio to (a)'s engine figure
(target >= 0.90 for GPU decode), and one evaluation pass (the engine's run_eval, the eval
model's first compilation included) timed after the training windows.

The engine decodes image files through torchcodec; where it cannot be imported (bench/gpu.sh
installs it from .gpu-wheels/) both parts are skipped with the reason."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from pathlib import Path

from bench.gpu.engine_runs import (
    close_run,
    engine_run,
    engine_steps,
    has_key,
    last_record,
    window_rates,
)
from bench.gpu.harness import Bench, Skip, attempt, cpu_count, get, timed
from bench.gpu.resnet import resnet_overrides
from bench.gpu.sizes import TARGETS
from bench.jpegs import missing_photos, write_jpeg_folder
from engine.data.errors import DataError
from engine.tracking import ProgressBar
from engine.train import run_eval
from engine.vision.codec import require_decoder


def _write_part(job: tuple) -> None:
    root, classes, per_class, val_per_class, seed = job
    write_jpeg_folder(Path(root), classes, per_class, val_per_class, seed)


def per_process(total: int, procs: int, classes: int) -> int:
    return max(1, math.ceil(total / (procs * classes)))


def write_parts(bench: Bench, procs: int) -> Path:
    """unique JPEGs written by `procs` processes, one folder each."""
    s = bench.sizes
    train = per_process(s.jpeg_unique, procs, s.jpeg_classes)
    val = per_process(s.jpeg_val, procs, s.jpeg_classes)
    parts = bench.tmp / "jpeg-parts"
    jobs = [(str(parts / f"p{w}"), s.jpeg_classes, train, val, 1000 + w) for w in range(procs)]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(procs) as pool:
        pool.map(_write_part, jobs)
    return parts


def link_parts(parts: Path, procs: int, root: Path, links: int) -> tuple[int, int, int]:
    """The parts merged under root, each train file linked `links` times: (unique, linked,
    val)."""
    unique = linked = val = 0
    for w in range(procs):
        for split in ("train", "val"):
            for class_dir in sorted((parts / f"p{w}" / split).iterdir()):
                target = root / split / class_dir.name
                target.mkdir(parents=True, exist_ok=True)
                for file in sorted(class_dir.iterdir()):
                    copies = links if split == "train" else 1
                    unique += split == "train"
                    val += split == "val"
                    for r in range(copies):
                        os.link(file, target / f"{file.stem}_p{w}_r{r}{file.suffix}")
                        linked += split == "train"
    return unique, linked, val


def decoder_missing() -> str | None:
    """Why the engine cannot decode image files here (torchcodec missing), or None."""
    try:
        require_decoder()
    except DataError as err:
        return f"{err} (bench/gpu.sh installs it from .gpu-wheels/: make gpu-wheels)"
    return None


def jpeg_folder(bench: Bench) -> dict:
    """unique JPEGs written in parallel (one folder per process, then merged), each linked
    `links` times under train/: an epoch long enough for the timed steps."""
    if "jpeg" in bench.cache:
        return bench.cache["jpeg"]
    if reason := missing_photos() or decoder_missing():
        raise Skip(reason)
    s = bench.sizes
    started = time.perf_counter()
    procs = max(1, min(cpu_count(), 16))
    parts = write_parts(bench, procs)
    root = bench.tmp / "imagenet-jpeg"
    unique, linked, val = link_parts(parts, procs, root, s.jpeg_links)
    size = sum(f.stat().st_size for f in (parts / "p0" / "train").rglob("*.JPEG"))
    count = sum(1 for _ in (parts / "p0" / "train").rglob("*.JPEG"))
    info = {
        "root": root,
        "unique_train_files": unique,
        "train_entries": linked,
        "val_files": val,
        "links_per_file": s.jpeg_links,
        "classes": s.jpeg_classes,
        "mean_file_kb": round(size / max(count, 1) / 1024, 1),
        "generation_s": round(time.perf_counter() - started, 1),
        "generation_processes": procs,
    }
    bench.cache["jpeg"] = info
    return info


def jpeg_overrides(bench: Bench, decode: str, compile_on: bool, workers: int) -> list[str]:
    """(a)'s run on the JPEG folder with `workers` loader workers and the decode path."""
    folder = jpeg_folder(bench)
    if not has_key("imagenet", "data.decode"):
        if decode == "gpu":
            raise Skip("this checkout's imagenet data config has no data.decode (GPU decode)")
        decode_override = []
    else:
        decode_override = [f"data.decode={decode}"]
    return resnet_overrides(bench, compile_on) + [
        *decode_override,
        "model.num_classes=1000",  # (a)'s model: the same work per image, and its compiled graph
        f"data.root={folder['root']}",
        f"data.index_cache={bench.tmp / 'index-cache'}",
        f"loader.num_workers={workers}",
        f"log.every_steps={bench.sizes.jpeg_window}",
    ]


def check_epoch_length(bench: Bench, run) -> None:
    s = bench.sizes
    needed = s.jpeg_warmup_steps + (1 + s.jpeg_windows) * s.jpeg_window
    if run.feed.sampler.steps_per_epoch < needed:
        raise RuntimeError(
            f"an epoch of {run.feed.sampler.steps_per_epoch} steps is shorter than the "
            f"{needed} steps this measurement needs; raise jpeg_links"
        )


def timed_windows(bench: Bench, run, windows: int) -> dict:
    """The warm-up steps, then a second iterator's `windows` windows (after one dropped):
    images/s and the breakdown of the timed windows. The dropped window is the workers
    refilling their queues, so the timed ones see the loader's steady state, not batches
    decoded while the first steps compiled."""
    s = bench.sizes
    window = run.cfg.log.every_steps
    warm = timed(bench, lambda: engine_steps(run, s.jpeg_warmup_steps))
    first_timed = run.progress.step + window
    wall = timed(bench, lambda: engine_steps(run, (1 + windows) * window))
    records, rate, shares = window_rates(run, first_timed, s.batch)
    return {
        "warmup_s": round(warm, 2),
        "timed_steps": len(records) * window,
        "img_per_s": round(rate, 1),
        "data_wait_fraction": shares["data_wait"],
        "breakdown": shares,
        "img_per_s_with_iterator_restart": round((1 + windows) * window * s.batch / wall, 1),
        "engine_metrics_record": last_record(run),
    }


def eval_pass(bench: Bench, run) -> dict:
    """One evaluation pass (the engine's run_eval), timed: the eval model's compilation and
    the eval loader's start included, as a user's first evaluation pays them."""
    images = len(run.feed.eval_data)
    progress = ProgressBar(1, run.progress.step, "off", False)
    seconds = timed(bench, lambda: run_eval(run, progress))
    return {
        "eval_images": images,
        "eval_s": round(seconds, 2),
        "eval_img_per_s": round(images / seconds, 1),
    }


def jpeg_run(bench: Bench, decode: str, compile_on: bool, synthetic: float | None) -> dict:
    s = bench.sizes
    workers = max(1, cpu_count() - 1)
    overrides = jpeg_overrides(bench, decode, compile_on, workers)
    run = engine_run(bench, "imagenet", overrides, f"b-{decode}")
    try:
        check_epoch_length(bench, run)
        windows = s.jpeg_windows // (2 if bench.tight("imagenet_jpeg") else 1)
        out = {"decode": decode, "compiled": compile_on, "loader_workers": workers}
        out |= timed_windows(bench, run, windows)
        out["budget_tight"] = windows < s.jpeg_windows
        out |= eval_pass(bench, run)
        if synthetic:
            out["over_synthetic_engine"] = round(out["img_per_s"] / synthetic, 4)
        if decode == "gpu" and bench.device.type != "cuda":
            out["note"] = "on a CPU device, decode=gpu decodes batches with the CPU: code path only"
        return out
    finally:
        close_run(run)


def imagenet_jpeg(bench: Bench) -> dict:
    synthetic = bench.cache.get("synthetic", {})
    compile_on = "compiled" in synthetic or (not synthetic and bench.device.type == "cuda")
    reference = synthetic.get("compiled" if compile_on else "eager")
    out = bench.entry("imagenet_jpeg")  # in the JSON from the start, the parts with it
    out |= {
        "folder": {k: v for k, v in jpeg_folder(bench).items() if k != "root"},
        "compared_with": f"(a) engine, {'compiled' if compile_on else 'eager'}: "
        + (f"{reference} img/s" if reference else "not measured"),
        "target": {"gpu_decode_over_synthetic": TARGETS["jpeg_gpu_decode_over_synthetic"]},
    }
    out["cpu_decode"] = attempt(
        bench,
        "imagenet_jpeg.cpu_decode",
        "(b) CPU decode",
        lambda: jpeg_run(bench, "cpu", compile_on, reference),
        need_s=bench.need(25),
    )
    out["gpu_decode"] = attempt(
        bench,
        "imagenet_jpeg.gpu_decode",
        "(b) GPU decode",
        lambda: jpeg_run(bench, "gpu", compile_on, reference),
        need_s=bench.need(25),
    )
    gpu = out["gpu_decode"]
    if gpu["status"] == "ok" and "over_synthetic_engine" in gpu:
        out["meets_0.90"] = gpu["over_synthetic_engine"] >= 0.90
    return out


def summary(entry: dict) -> list[str]:
    """The folder's generation, then img/s, data wait, the ratio to (a) and the evaluation
    pass for each decode path that ran."""
    folder = get(entry, "folder") or {}
    lines = []
    if "generation_s" in folder:
        lines.append(
            f"  (b) JPEG folder: {folder['unique_train_files']} train + {folder['val_files']} "
            f"val files generated in {folder['generation_s']:.1f} s"
        )
    for decode in ("cpu_decode", "gpu_decode"):
        part = get(entry, decode)
        if isinstance(part, dict) and part.get("status") == "ok":
            over = part.get("over_synthetic_engine")
            target = " (target >= 0.90)" if decode == "gpu_decode" else ""
            lines.append(
                f"  (b) JPEG {decode:10s} {part['img_per_s']:8.1f} img/s, data wait "
                f"{part['data_wait_fraction']:.1%}, over synthetic "
                f"{'n/a' if over is None else f'{over:.3f}'}{target}; eval "
                f"{part['eval_images']} images in {part['eval_s']:.1f} s"
            )
        elif isinstance(part, dict):
            lines.append(f"  (b) JPEG {decode}: {part.get('status')} {part.get('reason', '')}")
    return lines
