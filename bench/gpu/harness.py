"""The plumbing every measurement shares: the time budget, the result JSON (rewritten after
each measurement, atomically), attempt() that turns a failure into a recorded entry, the
watchdog that stops an overrunning run, timing and MFU helpers, and the summary's frame."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from bench.gpu.compile_log import dynamo_delta, dynamo_snapshot
from bench.gpu.sizes import MEASUREMENTS, REFERENCES, TARGETS, Sizes
from engine import catalog, speed

REPO = Path(__file__).resolve().parents[2]


class Skip(Exception):
    """A measurement (or part of one) that was not run, with the reason."""


class Bench:
    def __init__(self, args, sizes: Sizes, device: torch.device, out: Path):
        self.args, self.sizes, self.device, self.out = args, sizes, device, out
        self.smoke = args.smoke
        self.budget_s = args.budget
        self.started = time.perf_counter()
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
        self.cache: dict = {}  # data folders made once, (a)'s figures for (b)
        self.current = ""  # the part running now, for the watchdog's note
        self.measurement = ""  # the measurement running now
        self.lock = threading.Lock()
        self.result = {
            "script": "bench/gpu",
            "mode": "smoke" if self.smoke else "full",
            "argv": sys.argv[1:],
            "started_utc": utc_now(),
            "budget_s": self.budget_s,
            "device": str(device),
            "sizes": dataclasses.asdict(sizes),
            "targets": TARGETS,
            "references": REFERENCES,
            "notes": [],
            "versions": {},
            "measurements": {},
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def planned_rest(self, name: str) -> float:
        """Planned seconds of this measurement and those after it that will run."""
        only = set(filter(None, self.args.only.split(",")))
        gpt = "gpt" in catalog.available()
        names = [n for n, _ in self.sizes.planned_s]
        start = names.index(name) if name in names else len(names)
        return sum(
            seconds
            for n, seconds in self.sizes.planned_s[start:]
            if (not only or n in only) and (n != "gpt" or gpt)
        )

    def need(self, seconds: float) -> float:
        """The time a part needs to start at full size (smoke sizes need next to none)."""
        return 1.0 if self.smoke else seconds

    def tight(self, name: str) -> bool:
        """Less time left than planned from here on: timed parts shrink."""
        return self.remaining() < self.planned_rest(name)

    def say(self, text: str) -> None:
        print(f"[gpu-bench {self.elapsed():5.0f}s] {text}", flush=True)

    def note(self, text: str) -> None:
        self.result["notes"].append(text)

    def write(self, final: bool = False) -> None:
        with self.lock:
            self.result["elapsed_s"] = round(self.elapsed(), 1)
            if final:
                self.result["finished_utc"] = utc_now()
            text = None
            for _ in range(3):  # the watchdog may write while the main thread adds an entry
                try:
                    text = json.dumps(self.result, indent=2, default=str, allow_nan=False)
                    break
                except (RuntimeError, ValueError):
                    text = json.dumps(clean(self.result), indent=2, default=str)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            partial = self.out.with_name(self.out.name + ".partial")
            partial.write_text(text + "\n")
            os.replace(partial, self.out)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clean(value):
    """A copy that JSON can hold: non-finite floats as null."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in list(value.items())}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def error_entry(err: BaseException) -> dict:
    lines = traceback.format_exception(type(err), err, err.__traceback__)
    text = " ".join(str(err).split()) or type(err).__name__
    return {
        "status": "error",
        "error": f"{type(err).__name__}: {text}"[:2000],
        "traceback": "".join(lines)[-3000:],
    }


# ---------------------------------------------------------------- one recorded part


def attempt(bench: Bench, label: str, fn, need_s: float = 0.0, memory: bool = True) -> dict:
    """fn() -> dict, recorded with its status, seconds, GPU memory high-water mark and
    torch.compile activity; an exception becomes an error entry, Skip a skipped one."""
    if need_s and bench.remaining() < need_s:
        left = max(0.0, bench.remaining())
        return {
            "status": "skipped",
            "reason": f"needs ~{need_s:.0f} s, {left:.0f} s left of the budget",
        }
    previous, bench.current = bench.current, label
    bench.say(f"{label} ...")
    reset_peak(bench.device)
    before = dynamo_snapshot()
    started = time.perf_counter()
    try:
        entry = {"status": "ok"} | fn()
    except Skip as why:
        entry = {"status": "skipped", "reason": str(why)}
    except Exception as err:  # every failure is a figure too: record it and go on
        entry = error_entry(err)
    entry["seconds"] = round(time.perf_counter() - started, 2)
    peak = peak_memory_gb(bench.device) if memory else None
    if peak is not None:
        entry["peak_memory_gb"] = max(peak, nested_max(entry, "peak_memory_gb") or 0.0)
    change = dynamo_delta(before, dynamo_snapshot())
    if change:
        entry["torch_compile"] = change
    bench.current = previous
    free_device_memory(bench.device)
    bench.say(f"{label}: {entry['status']}{describe(entry)}")
    return entry


def describe(entry: dict) -> str:
    if entry["status"] == "error":
        return f" ({entry['error'][:300]})"
    if entry["status"] == "skipped":
        return f" ({entry['reason']})"
    return f" in {entry['seconds']:.1f}s"


def nested_max(value, key: str):
    """The largest number under `key` anywhere in nested dicts and lists."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            if k == key and isinstance(v, int | float):
                found.append(v)
            elif isinstance(v, dict | list):
                inner = nested_max(v, key)
                if inner is not None:
                    found.append(inner)
    elif isinstance(value, list):
        found += [m for m in (nested_max(v, key) for v in value) if m is not None]
    return max(found) if found else None


def start_watchdog(bench: Bench, grace_s: float = 15.0) -> None:
    """Past the budget plus grace: record where it stood, write the JSON and stop."""

    def watch():
        while bench.remaining() > -grace_s:
            time.sleep(1.0)
        where = bench.current or "between measurements"
        bench.note(f"aborted by the watchdog {grace_s:.0f} s past the budget, during: {where}")
        bench.result["aborted"] = where
        results = bench.result["measurements"]
        for name in MEASUREMENTS:
            if name == bench.measurement:
                results[name] = {"status": "error", "error": f"aborted over the budget: {where}"}
            elif name not in results:
                results[name] = {"status": "skipped", "reason": "not reached: over the budget"}
        bench.write(final=True)
        print(f"gpu-bench: over the budget during {where}; results so far: {bench.out}", flush=True)
        shutil.rmtree(bench.tmp, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="gpu-bench-watchdog").start()


# ---------------------------------------------------------------- device memory and time


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    """engine.speed's high-water mark, rounded for the JSON; None on a CPU."""
    peak = speed.gpu_memory_gb(device)
    return None if peak is None else round(peak, 3)


def free_device_memory(device: torch.device) -> None:
    """Drop what the last part left behind, so the next one's high-water mark is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(bench: Bench, fn) -> float:
    bench.sync()
    started = time.perf_counter()
    fn()
    bench.sync()
    return time.perf_counter() - started


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- MFU


def device_peak(device: torch.device) -> tuple[float, str]:
    """engine.speed's dense bf16 datasheet peak of the device (0: no MFU), and a note on it."""
    peak = speed.peak_flops(0.0, device)  # 0.0: no log.peak_tflops, the datasheet's figure
    if device.type != "cuda":
        return peak, "no peak for a CPU: no MFU"
    name = torch.cuda.get_device_name(device)
    if not peak:
        return peak, f"no datasheet peak known for {name}: no MFU"
    return peak, f"{name} dense bf16 {peak / 1e12:g} TFLOP/s (datasheet)"


def mfu(samples_per_s: float | None, flops: float, peak: float) -> float | None:
    if not samples_per_s or not flops or not peak:
        return None
    return round(samples_per_s * flops / peak, 4)


# ---------------------------------------------------------------- the printed summary


def get(entry, *keys):
    """entry[k1][k2]...; None where a level is missing or not a dict."""
    for k in keys:
        if not isinstance(entry, dict) or k not in entry:
            return None
        entry = entry[k]
    return entry


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_head(bench: Bench) -> str:
    return f"GPU benchmark ({bench.result['mode']}), {bench.result['versions'].get('gpu', 'CPU')}"


def summary_failures(measurements: dict) -> list[str]:
    """One line for each measurement that did not end ok."""
    return [
        f"  {name}: {entry['status']} {entry.get('reason') or entry.get('error', '')}"
        for name, entry in measurements.items()
        if entry.get("status") not in ("ok", None)
    ]
