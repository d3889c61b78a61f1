"""(b) imagenet_jpeg: (a)'s engine run fed from a folder of real ImageNet-sized JPEGs
(bench/jpegs.py, each file linked several times so that an epoch is long), decoded on the CPU
by loader.num_workers = cores - 1, and with data.decode=gpu (nvJPEG): images/s, the fraction
of time the loop waited for data (the engine's data_wait), and the ratio to (a)'s engine
figure (target >= 0.90 for GPU decode)."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from pathlib import Path

from bench.gpu.engine_runs import close_run, engine_run, engine_steps, has_key, last_record
from bench.gpu.harness import Bench, Skip, attempt, cpu_count, get, timed
from bench.gpu.resnet import resnet_overrides
from bench.gpu.sizes import TARGETS
from bench.jpegs import missing_photos, write_jpeg_folder


def _write_part(job: tuple) -> None:
    root, classes, per_class, seed = job
    write_jpeg_folder(Path(root), classes, per_class, 1, seed)


def write_parts(bench: Bench, procs: int) -> Path:
    """unique JPEGs written by `procs` processes, one folder each."""
    s = bench.sizes
    per_class = max(1, math.ceil(s.jpeg_unique / (procs * s.jpeg_classes)))
    parts = bench.tmp / "jpeg-parts"
    jobs = [(str(parts / f"p{w}"), s.jpeg_classes, per_class, 1000 + w) for w in range(procs)]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(procs) as pool:
        pool.map(_write_part, jobs)
    return parts


def link_parts(parts: Path, procs: int, root: Path, links: int) -> tuple[int, int]:
    """The parts merged under root, each train file linked `links` times: (unique, linked)."""
    unique = linked = 0
    for w in range(procs):
        for split in ("train", "val"):
            for class_dir in sorted((parts / f"p{w}" / split).iterdir()):
                target = root / split / class_dir.name
                target.mkdir(parents=True, exist_ok=True)
                for file in sorted(class_dir.iterdir()):
                    copies = links if split == "train" else 1
                    unique += split == "train"
                    for r in range(copies):
                        os.link(file, target / f"{file.stem}_p{w}_r{r}{file.suffix}")
                        linked += split == "train"
    return unique, linked


def jpeg_folder(bench: Bench) -> dict:
    """unique JPEGs written in parallel (one folder per process, then merged), each linked
    `links` times under train/: an epoch long enough for the timed steps."""
    if "jpeg" in bench.cache:
        return bench.cache["jpeg"]
    if reason := missing_photos():
        raise Skip(reason)
    s = bench.sizes
    started = time.perf_counter()
    procs = max(1, min(cpu_count(), 16))
    parts = write_parts(bench, procs)
    root = bench.tmp / "imagenet-jpeg"
    unique, linked = link_parts(parts, procs, root, s.jpeg_links)
    size = sum(f.stat().st_size for f in (parts / "p0" / "train").rglob("*.JPEG"))
    count = sum(1 for _ in (parts / "p0" / "train").rglob("*.JPEG"))
    info = {
        "root": root,
        "unique_train_files": unique,
        "train_entries": linked,
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


def window_rates(bench: Bench, run, first_timed: int) -> tuple[list[dict], float, float]:
    """The engine's metrics windows after `first_timed`: (records, img/s, data-wait fraction),
    both weighted by each window's time."""
    records = [
        r
        for r in run.records.tracker.records
        if r.get("kind") == "train" and r["step"] > first_timed
    ]
    if not records:
        raise RuntimeError("the engine wrote no metrics records in the timed windows")
    samples = bench.sizes.jpeg_window * bench.sizes.batch
    seconds = [samples / r["samples_per_s"] for r in records]
    rate = len(records) * samples / sum(seconds)
    wait = sum(r["data_wait"] * t for r, t in zip(records, seconds, strict=True)) / sum(seconds)
    return records, rate, wait


def jpeg_run(bench: Bench, decode: str, compile_on: bool, synthetic: float | None) -> dict:
    s = bench.sizes
    workers = max(1, cpu_count() - 1)
    overrides = jpeg_overrides(bench, decode, compile_on, workers)
    run = engine_run(bench, "imagenet", overrides, f"b-{decode}")
    try:
        check_epoch_length(bench, run)
        warm = timed(bench, lambda: engine_steps(run, s.jpeg_warmup_steps))
        # A second iterator: its first window (the workers refilling their queues) is dropped,
        # so the timed windows see the loader's steady state, not batches decoded while the
        # first steps compiled.
        first_timed = run.progress.step + s.jpeg_window
        windows = s.jpeg_windows // (2 if bench.tight("imagenet_jpeg") else 1)
        wall = timed(bench, lambda: engine_steps(run, (1 + windows) * s.jpeg_window))
        records, rate, wait = window_rates(bench, run, first_timed)
        out = {
            "decode": decode,
            "compiled": compile_on,
            "loader_workers": workers,
            "warmup_s": round(warm, 2),
            "timed_steps": len(records) * s.jpeg_window,
            "budget_tight": windows < s.jpeg_windows,
            "img_per_s": round(rate, 1),
            "data_wait_fraction": round(wait, 4),
            "img_per_s_with_iterator_restart": round(
                (1 + windows) * s.jpeg_window * s.batch / wall, 1
            ),
            "engine_metrics_record": last_record(run),
        }
        if synthetic:
            out["over_synthetic_engine"] = round(rate / synthetic, 4)
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
    """img/s, data wait and the ratio to (a) for each decode path that ran."""
    lines = []
    for decode in ("cpu_decode", "gpu_decode"):
        part = get(entry, decode)
        if isinstance(part, dict) and part.get("status") == "ok":
            over = part.get("over_synthetic_engine")
            target = " (target >= 0.90)" if decode == "gpu_decode" else ""
            lines.append(
                f"  (b) JPEG {decode:10s} {part['img_per_s']:8.1f} img/s, data wait "
                f"{part['data_wait_fraction']:.1%}, over synthetic "
                f"{'n/a' if over is None else f'{over:.3f}'}{target}"
            )
        elif isinstance(part, dict):
            lines.append(f"  (b) JPEG {decode}: {part.get('status')} {part.get('reason', '')}")
    return lines
