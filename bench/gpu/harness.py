"""The plumbing every measurement shares: the time budget, the result JSON (rewritten
atomically as each part starts and ends), attempt() that runs one part, files its entry under
its dotted name and turns a failure into a recorded entry, the watchdog that stops an
overrunning run and keeps what was measured, timing and MFU helpers, and the summary's frame."""

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
from typing import NoReturn

import torch

from bench.gpu.compile_log import dynamo_delta, dynamo_snapshot
from bench.gpu.sizes import MEASUREMENTS, REFERENCES, TARGETS, WATCHDOG_GRACE_S, Sizes, selectable
from engine import catalog, speed

REPO = Path(__file__).resolve().parents[2]
PLANT_STALL = "GPU_BENCH_PLANT_STALL"  # a part's dotted name: it stalls (tests the watchdog)


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
        self.only = set(filter(None, args.only.split(",")))  # --only: names to run
        self.current = ""  # the label of the part running now, for the watchdog's note
        self.running: list[str] = []  # dotted names of the parts running now, outermost first
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

    def selected(self, key: str) -> bool:
        """Whether --only lets the part (or measurement) `key` run: it, a group above it, or a
        part below it is named (or nothing is)."""
        if key not in selectable():
            raise ValueError(f"{key!r} is not in bench.gpu.sizes.PARTS")
        return not self.only or any(
            key == name or key.startswith(name + ".") or name.startswith(key + ".")
            for name in self.only
        )

    def entry(self, key: str) -> dict:
        """The dict filed under measurements.<key> (made empty where missing): a measurement
        adds its figures to it as they come, and attempt() files its parts in it."""
        node = self.result["measurements"]
        for step in key.split("."):
            node = node.setdefault(step, {})
        return node

    def file(self, key: str, entry: dict) -> dict:
        """entry under measurements.<key>, replacing what was there."""
        parent, _, last = key.rpartition(".")
        (self.entry(parent) if parent else self.result["measurements"])[last] = entry
        return entry

    def planned_rest(self, name: str) -> float:
        """Planned seconds of this measurement and those after it that will run."""
        gpt = "gpt" in catalog.available()
        names = [n for n, _ in self.sizes.planned_s]
        start = names.index(name) if name in names else len(names)
        return sum(
            seconds
            for n, seconds in self.sizes.planned_s[start:]
            if self.selected(n) and (n != "gpt" or gpt)
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


def attempt(
    bench: Bench, key: str, label: str, fn, need_s: float = 0.0, memory: bool = True
) -> dict:
    """fn() -> dict, recorded with its status, seconds, GPU memory high-water mark and
    torch.compile activity, filed under measurements.<key> (a dotted name of sizes.PARTS) and
    the JSON rewritten; an exception becomes an error entry, Skip a skipped one. The entry is
    there from the start (status running), so that the parts fn files under it, and the
    figures it adds through bench.entry(key), are kept whatever happens next."""
    refused = refusal(bench, key, need_s)
    if refused:
        return bench.file(key, {"status": "skipped", "reason": refused})
    if os.environ.get(PLANT_STALL) == key:
        fn = lambda: planted_stall(bench, key)  # noqa: E731
    live = bench.file(key, {"status": "running"})
    previous, bench.current = bench.current, label
    bench.running.append(key)
    bench.say(f"{label} ...")
    bench.write()
    reset_peak(bench.device)
    before = dynamo_snapshot()
    started = time.perf_counter()
    try:
        entry = outcome(fn, live)
    finally:
        bench.running.pop()
    entry["seconds"] = round(time.perf_counter() - started, 2)
    peak = peak_memory_gb(bench.device) if memory else None
    if peak is not None:
        entry["peak_memory_gb"] = max(peak, nested_max(entry, "peak_memory_gb") or 0.0)
    change = dynamo_delta(before, dynamo_snapshot())
    if change:
        entry["torch_compile"] = change
    bench.current = previous
    free_device_memory(bench.device)
    bench.file(key, entry)
    bench.write()
    bench.say(f"{label}: {entry['status']}{describe(entry)}")
    return entry


def planted_stall(bench: Bench, key: str) -> NoReturn:
    """GPU_BENCH_PLANT_STALL=<key>: the part overruns. The budget ended the watchdog's grace
    before the part started, so the watchdog stops the run a second later (a test need wait
    out neither the budget nor the grace)."""
    bench.note(f"{PLANT_STALL}={key}: this part stalled on purpose; the budget ended there")
    bench.budget_s = bench.elapsed() - WATCHDOG_GRACE_S + 1.0
    time.sleep(120.0)  # the watchdog ends the process long before
    raise RuntimeError(f"{PLANT_STALL}: the watchdog did not stop the run")


def refusal(bench: Bench, key: str, need_s: float) -> str:
    """Why the part does not start ("": it does)."""
    if not bench.selected(key):
        return "not selected (--only)"
    if need_s and bench.remaining() < need_s:
        left = max(0.0, bench.remaining())
        return f"needs ~{need_s:.0f} s, {left:.0f} s left of the budget"
    return ""


def outcome(fn, live: dict) -> dict:
    """fn()'s entry over what it filed in `live` while it ran; a failure keeps those too."""
    try:
        result = fn()  # first: the parts it files in live while it runs
        entry = {"status": "ok"} | live | result
        if entry["status"] == "running":
            entry["status"] = "ok"
    except Skip as why:
        entry = {"status": "skipped"} | live | {"status": "skipped", "reason": str(why)}
    except Exception as err:  # every failure is a figure too: record it and go on
        entry = {"status": "error"} | live | error_entry(err)
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


def start_watchdog(bench: Bench, grace_s: float = WATCHDOG_GRACE_S) -> None:
    """Past the budget plus grace: record where it stood, write the JSON and stop. The parts
    that ended are kept; each running one (the part and the measurement around it) is marked
    aborted, its finished parts kept with it."""

    def watch():
        while bench.remaining() > -grace_s:
            time.sleep(1.0)
        running = list(bench.running)
        where = running[-1] if running else "between measurements"
        label = f", {bench.current!r}" if running and bench.current else ""
        bench.note(
            f"aborted by the watchdog {grace_s:.0f} s past the budget, during {where}{label}"
        )
        bench.result["aborted"] = where
        for key in running:
            entry = bench.entry(key)
            entry["status"] = "aborted"
            entry["reason"] = f"over the budget: the watchdog stopped the run during {where}"
        results = bench.result["measurements"]
        for name in MEASUREMENTS:
            if name not in results:
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
