"""The one-shot GPU benchmark: every speed figure of the repo in one run, into one JSON file.

Run it from the repository root on a machine with one NVIDIA GPU:

    bash bench/gpu.sh                          # 7.5 minutes at most; prints the JSON path
    OUT=/some/dir bash bench/gpu.sh            # writes $OUT/gpu.json instead of runs/bench/
    GPU_BENCH_BUDGET_S=300 bash bench/gpu.sh   # a shorter budget: later items shrink or skip
    bash bench/gpu.sh --smoke                  # tiny sizes (CPU when no GPU): proves the code
    bash bench/gpu.sh --only resnet50_synthetic,cifar10_fast   # a subset, e.g. for a rerun
    RECIPES_GIT_SHA=<sha> bash bench/gpu.sh    # records the commit where the copy has no .git
    GPU_BENCH_PYTHON=.venv/bin/python bash bench/gpu.sh   # another interpreter than python3

It needs only python3 with torch, torchvision, numpy, pyyaml, pillow and scikit-learn (no
W&B, no submitit, no network). Each measurement runs in its own try/except: a failure is
recorded in the JSON (`status: error`, the error line and the end of the traceback) and the
next one runs. A measurement that does not fit the time left is skipped with the reason, or
shrinks (half the timed steps, `budget_tight: true`); a watchdog writes the JSON and stops the script
once the budget (default 440 s, GPU_BENCH_BUDGET_S or --budget) is overrun by 15 s.
The JSON is rewritten after every measurement, so a killed run still leaves what it measured.

What each figure means (warm-up steps, compilation included, are never in a throughput; every
timed span starts and ends with torch.cuda.synchronize):

  versions            python, torch, torchvision, CUDA, cuDNN, GPU, driver, git SHA: what ran.
  resnet50_synthetic  (a) ResNet-50, bf16 autocast, channels_last, batch 256, SGD: images/s
                      through the engine (its loop, sampler, loader, metering) against a bare
                      hand-written loop on the same model and flags, eager and torch.compile'd.
                      The data are uint8 images resident on the device, gathered and
                      normalised each step (the engine's DeviceImages; the bare loop does the
                      same gather), so neither side waits for decoding. Timed segments
                      alternate engine/bare; figures are medians, the ratio the median of the
                      pairwise ratios. Targets: >= 3500 img/s each, engine/bare >= 0.95.
  imagenet_jpeg       (b) the same engine run fed from a folder of real ImageNet-sized JPEGs
                      (bench/jpegs.py, each file linked several times so that an epoch is
                      long), decoded on the CPU by loader.num_workers = cores - 1, and with
                      data.decode=gpu (nvJPEG): images/s, the fraction of time the loop waited
                      for data (the engine's data_wait), and the ratio to (a)'s engine figure
                      (target >= 0.90 for GPU decode).
  cifar10_fast        (c) the CIFAR-10 fast variant (airbench-style, data on the device) on
                      generated data of the real shape (50k train, 10k test, 32x32): seconds
                      per epoch and the projected time of its 475-step (9.9-epoch) budget.
                      Accuracy (94% is the aim) can only be measured on the real CIFAR-10:
                      when its files are at the recipe's data.root, the run to the end and
                      its final top-1 are measured too.
  compile_recompiles  (d) torch.compile recompilations and graph breaks over training steps,
                      an epoch boundary and evaluation passes (the CIFAR-10 fast run), with
                      the guard that triggered each recompilation.
  memory_and_mfu      (e) the GPU memory high-water mark (torch.cuda.max_memory_allocated)
                      and MFU of every measurement, gathered in one table. MFU = achieved
                      training FLOP/s over the GPU's dense bf16 datasheet peak (H100/H200:
                      989 TFLOP/s). Training FLOPs per sample = 3x the forward FLOPs counted
                      by torch's FlopCounterMode (2 FLOPs per multiply-add, as the engine's
                      own mfu): ResNet-50 at 224 px is 4.1 G multiply-adds = 8.2 GFLOPs
                      forward, 24.5 GFLOPs per trained image.
  gpt                 (f) recipes/gpt on this one GPU, outside the engine's loop: the recipe's
                      model built on the meta device, given storage on the GPU and filled
                      per parameter name by the recipe's init_weights (as
                      engine/parallel/weights.py does, but drawn on the device), bf16
                      autocast, AdamW (fused on CUDA; weight decay 0.1 on matrices only),
                      gradient clipping at 1.0, random byte tokens resident on the device.
                      speed: the `124m` variant at 16 x 1024 tokens per step: tokens/s, MFU
                      (recipes.gpt.model.flops_per_token x tokens/s over the dense bf16 peak
                      of engine/speed.py) and the memory high-water mark, eager without and
                      with activation checkpointing (engine.parallel.activations on the
                      blocks) and torch.compile'd (the whole model, as the engine compiles a
                      one-GPU or DDP run) without it. memory: the `1b` variant at 4 x 2048
                      tokens per step, with and without activation checkpointing: the
                      high-water mark of training steps after the first (so AdamW's moments
                      exist) next to recipes/gpt/memory.py's estimate for the same micro batch
                      on one GPU (its DDP column); running out of memory is recorded as such.
                      The block keeps to its share of the budget (90 s): a part that does
                      not fit what is left of it is skipped with the reason.

The printed summary puts each figure beside its target; the JSON also holds published
reference figures (labelled references, with their sources) for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import distributed as D
from engine import recipe as R
from engine.config import ENGINE_SECTIONS
from engine.speed import PEAK_BF16_TFLOPS  # datasheet dense bf16, SXM parts
from engine.train import Progress, load_config, run_eval, setup, train_epoch

REPO = Path(__file__).resolve().parent.parent
MEASUREMENTS = (
    "resnet50_synthetic",
    "imagenet_jpeg",
    "cifar10_fast",
    "compile_recompiles",
    "gpt",
    "memory_and_mfu",
)
TARGETS = {
    "resnet50_img_per_s": ">= 3500 (bare and engine, bf16, channels_last, batch 256)",
    "engine_over_bare": ">= 0.95",
    "jpeg_gpu_decode_over_synthetic": ">= 0.90",
}
REFERENCES = [
    {
        "what": "ResNet-50 v1.5 training, mixed precision, 1 GPU of a DGX A100 (A100 80GB)",
        "img_per_s": 2470,
        "source": "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/"
        "README.md, 'Training performance: NVIDIA DGX A100 (8x A100 80GB)' (NGC 21.03)",
    },
    {
        "what": "ResNet-50 training, AMP, channels_last, one A100",
        "img_per_s": 2600,
        "source": "timm's benchmark tracker, as quoted when this benchmark was specified "
        "(approximate; the train benchmark CSVs in timm's results/ folder are for an "
        "RTX 3090, so the A100 figure is not traced to a file here)",
    },
    {
        "what": "airbench94: CIFAR-10 to 94.01% top-1, one A100",
        "seconds": 3.83,
        "source": "Keller Jordan, airbench (github.com/KellerJordan/cifar10-airbench), "
        "as quoted in recipes/cifar10/fast.yaml",
    },
]
RESNET50_FORWARD_GMACS = 4.1  # the usual "4.1 GFLOPs" of ResNet-50 at 224 px: multiply-adds


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each measurement is; the full run's sizes fit the 8-minute budget on an H100."""

    arch: str = "resnet50"
    image: int = 224
    batch: int = 256
    amp: str = "bf16"
    device_images: int = 4096  # synthetic uint8 images resident on the device (16 batches)
    warmup_steps: int = 8  # after the first (compiling) step, per path
    segments: int = 3  # timed segments per path, alternating engine and bare
    segment_s: float = 2.0  # aimed length of one timed segment
    segment_steps: tuple[int, int] = (5, 40)  # its bounds in steps
    jpeg_unique: int = 2048  # distinct JPEG files generated
    jpeg_links: int = 8  # hard links per file: an epoch of unique * links images
    jpeg_classes: int = 16
    jpeg_window: int = 5  # log.every_steps: the engine meters throughput per window
    jpeg_warmup_steps: int = 10  # first iterator: worker start and compilation
    jpeg_windows: int = 8  # timed windows, after one discarded window of the second iterator
    cifar_train: int = 50_000
    cifar_test: int = 10_000
    cifar_epochs: int = 3  # timed epochs after the first (compiling) one
    cifar_overrides: tuple[str, ...] = ()
    cifar_real_overrides: tuple[str, ...] = ()  # the run to the end on real files
    gpt_speed_variant: str = "124m"  # recipes/gpt/<variant>.yaml; "config": config.yaml
    gpt_speed_batch: int = 16  # sequences per step (124m's micro batch per GPU)
    gpt_memory_variant: str = "1b"
    gpt_memory_batch: int = 4
    gpt_seq: int | None = None  # tokens per sequence; None: the variant's data.block_size
    gpt_warmup_steps: int = 3  # after the first (compiling) step
    gpt_segment_s: float = 3.0  # aimed length of the timed span
    gpt_steps: tuple[int, int] = (5, 40)  # its bounds in steps
    gpt_memory_steps: int = 3  # steps after the first whose high-water mark is kept
    gpt_share_s: float = 90.0  # parts start only within this many seconds of the block's start
    compile_backend: str | None = None  # None: torch's default (inductor)
    planned_s: tuple[tuple[str, float], ...] = (  # rough cost on an H100, for the budget
        ("resnet50_synthetic", 155),
        ("imagenet_jpeg", 100),
        ("cifar10_fast", 60),
        ("compile_recompiles", 35),
        ("gpt", 90),
    )


SMOKE = Sizes(
    arch="resnet18",
    image=64,  # the smallest whose last ResNet feature map is larger than 1x1
    batch=4,
    device_images=32,
    warmup_steps=1,
    segments=2,
    segment_s=0.2,
    segment_steps=(2, 3),
    jpeg_unique=16,
    jpeg_links=4,
    jpeg_classes=2,
    jpeg_window=1,
    jpeg_warmup_steps=2,
    jpeg_windows=2,
    cifar_train=1024,
    cifar_test=256,
    cifar_epochs=1,
    cifar_overrides=("train.batch_size=256", "eval.batch_size=256", "model.widths=[16,32,32]"),
    cifar_real_overrides=("train.max_steps=6",),
    gpt_speed_variant="config",  # ~390 K parameters, 64-byte blocks
    gpt_speed_batch=4,
    gpt_memory_variant="config",
    gpt_memory_batch=2,
    gpt_warmup_steps=1,
    gpt_segment_s=0.2,
    gpt_steps=(2, 3),
    gpt_memory_steps=2,
    gpt_share_s=120.0,
    planned_s=tuple((name, 10.0) for name in MEASUREMENTS),
)


class Skip(Exception):
    """A measurement (or part of one) that was not run, with the reason."""


# ---------------------------------------------------------------- the bench and its JSON


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
            "script": "bench/gpu.py",
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
        gpt = "gpt" in R.available()
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
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
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


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


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


# ---------------------------------------------------------------- versions


def versions(device: torch.device) -> dict:
    import numpy
    import PIL
    import torchvision

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": numpy.__version__,
        "pillow": PIL.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "platform": platform.platform(),
        "cpu_count": cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    with contextlib.suppress(Exception):
        import triton

        v["triton"] = triton.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        v |= {
            "gpu": torch.cuda.get_device_name(device),
            "gpu_count": torch.cuda.device_count(),
            "gpu_memory_gb": round(props.total_memory / 2**30, 1),
            "gpu_capability": f"{props.major}.{props.minor}",
            "gpu_multiprocessors": props.multi_processor_count,
            "driver": nvidia_driver(),
        }
    v["git_sha"], v["git_dirty"] = git_state()
    if v["git_sha"] is None:
        v["git_sha_note"] = "no git checkout here and RECIPES_GIT_SHA unset"
    return v


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (
        out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    )


def git_state() -> tuple[str | None, bool | None]:
    def git(*args):
        try:
            out = subprocess.run(
                ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return os.environ.get("RECIPES_GIT_SHA") or None, None
    status = git("status", "--porcelain")
    return sha, None if status is None else bool(status)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- torch.compile activity

RECOMPILES: list[str] = []


class _RecompileLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Recompiling function" in message:
            RECOMPILES.append(message)


def watch_recompiles() -> None:
    """Dynamo logs each recompilation with the guard that failed; keep those messages."""
    try:
        torch._logging.set_logs(recompiles=True)
    except Exception:  # a torch without the artifact: frames are still counted
        return
    logging.getLogger("torch._dynamo").addHandler(_RecompileLog())


def dynamo_snapshot() -> dict:
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {
        "frames_compiled": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": dict(counters["graph_break"]),
        "recompiles": len(RECOMPILES),
    }


def dynamo_delta(before: dict, after: dict) -> dict:
    if not before or not after:
        return {}
    out = {k: after[k] - before[k] for k in ("frames_compiled", "graphs", "recompiles")}
    breaks = {
        reason: n - before["graph_breaks"].get(reason, 0)
        for reason, n in after["graph_breaks"].items()
        if n != before["graph_breaks"].get(reason, 0)
    }
    out["graph_breaks"] = sum(breaks.values())
    if breaks:
        out["graph_break_reasons"] = {k[:300]: v for k, v in breaks.items()}
    if after["recompiles"] > before["recompiles"]:
        out["recompile_reasons"] = [
            first_lines(m) for m in RECOMPILES[before["recompiles"] : after["recompiles"]][:10]
        ]
    return out if any(out.values()) else {}


def first_lines(message: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in message.splitlines()[:n])[:400]


def use_compile_backend(backend: str | None) -> None:
    """Smoke runs on CPU compile with a quick backend (dynamo's capture, guards and
    recompilations all run; inductor's code generation does not)."""
    if backend is None:
        return
    if hasattr(torch.compiler, "set_default_backend"):
        torch.compiler.set_default_backend(backend)
        return
    original = torch.compile

    def compile_with(*args, **kwargs):
        kwargs.setdefault("backend", backend)
        return original(*args, **kwargs)

    torch.compile = compile_with


# ---------------------------------------------------------------- engine helpers


def has_key(recipe_name: str, dotted: str) -> bool:
    """Whether this checkout's config knows `section.field` (switches land over time)."""
    section, _, name = dotted.partition(".")
    recipe = R.load(recipe_name)
    cls = {"model": recipe.model_config, "data": recipe.data_config}.get(section)
    cls = cls or ENGINE_SECTIONS.get(section)
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)}


class Capture:
    """The run's tracker, keeping each record in memory as well."""

    def __init__(self, tracker):
        self.tracker, self.records = tracker, []

    def write(self, record: dict) -> None:
        self.records.append(dict(record))
        self.tracker.write(record)

    def close(self) -> None:
        self.tracker.close()


def engine_run(bench: Bench, recipe: str, overrides: list[str], name: str, variant: str = ""):
    common = [
        "log.wandb=off",
        "log.progress=off",
        f"run.root={bench.tmp / 'runs'}",
        f"run.name={name}",
        f"device={bench.device.type}",
    ]
    cfg, rec = load_config(recipe, [*common, *overrides], variant)
    run = setup(cfg, rec, D.DistEnv(), bench.device)
    run.tracker = Capture(run.tracker)
    return run


def close_run(run) -> None:
    with contextlib.suppress(Exception):
        run.tracker.close()
    if getattr(run, "lock_fd", None) is not None:
        with contextlib.suppress(OSError):
            os.close(run.lock_fd)
        run.lock_fd = None
    iterator = getattr(run.loader, "_iterator", None)  # persistent loader workers
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        with contextlib.suppress(Exception):
            iterator._shutdown_workers()


def engine_steps(run, n: int) -> None:
    """n optimizer steps through the engine's own loop (train_epoch), crossing epoch ends as
    it does, without the evaluation and checkpoint that fit() adds there."""
    target = run.state.step + n
    run.total_steps = target
    progress = Progress(target, run.state.step, "off", False)
    epoch_samples = run.sampler.steps_per_epoch * run.sampler.plan.global_batch
    while run.state.step < target:
        reason = train_epoch(run, progress)
        if reason:
            raise RuntimeError(f"the engine stopped early: {reason}")
        if run.state.position >= epoch_samples:
            run.state.epoch += 1
            run.state.position = 0


def timed(bench: Bench, fn) -> float:
    bench.sync()
    started = time.perf_counter()
    fn()
    bench.sync()
    return time.perf_counter() - started


def segment_steps(bench: Bench, step_s: float, name: str) -> int:
    lo, hi = bench.sizes.segment_steps
    aim = bench.sizes.segment_s / (2 if bench.tight(name) else 1)
    return int(min(hi, max(lo, round(aim / max(step_s, 1e-6)))))


def train_flops_per_sample(recipe_name: str, model_cfg, shape: tuple[int, ...]) -> float:
    """3x the forward FLOPs (FlopCounterMode: 2 per multiply-add), on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    recipe = R.load(recipe_name)
    with torch.device("meta"):
        model = recipe.build_model(dataclasses.replace(model_cfg)).eval()  # same FLOPs
        sample = torch.zeros((1, *shape))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(sample)
    return 3.0 * counter.get_total_flops()


def peak_flops(device: torch.device) -> tuple[float, str]:
    if device.type != "cuda":
        return 0.0, "no peak for a CPU: no MFU"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12, f"{key} dense bf16 {tflops:g} TFLOP/s (datasheet)"
    return 0.0, f"no datasheet peak known for {name}: no MFU"


def mfu(samples_per_s: float | None, flops: float, peak: float) -> float | None:
    if not samples_per_s or not flops or not peak:
        return None
    return round(samples_per_s * flops / peak, 4)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------- (a) ResNet-50, synthetic


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


def device_images(n: int, size: int, classes: int, device: torch.device):
    from engine.data.device import DeviceImages
    from engine.data.images import IMAGENET_MEAN, IMAGENET_STD

    gen = torch.Generator(device=device).manual_seed(0)
    shape = (n, 3, size, size)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen, device=device)
    labels = torch.randint(0, classes, (n,), generator=gen, device=device)
    names = [f"class{c:04d}" for c in range(classes)]
    return DeviceImages(images, labels, IMAGENET_MEAN, IMAGENET_STD, classes=names)


def resnet_overrides(bench: Bench, compile_on: bool) -> list[str]:
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


def resnet_pair(bench: Bench, compiled: bool, flops: float, peak: float) -> dict:
    """Engine and bare loop on one model each, timed in alternating segments."""
    s, device = bench.sizes, bench.device
    overrides = resnet_overrides(bench, compiled)
    overrides += ["data.synthetic=true", f"data.synthetic_train={s.device_images}"]
    overrides += [f"data.synthetic_val={s.batch}", "data.synthetic_classes=1000"]
    from engine.data.loaders import train_loader

    run = engine_run(bench, "imagenet", overrides, f"a-{'compiled' if compiled else 'eager'}")
    try:
        data = device_images(s.device_images, s.image, 1000, device)
        run.train_data = data  # the engine's on-device path: no workers, no copies
        run.loader = train_loader(data, run.sampler, run.cfg.loader, device)
        model = R.load("imagenet").build_model(run.cfg.model)
        layout = torch.channels_last
        model = model.to(device, memory_format=layout)
        flags = {k: run.optimizer.defaults.get(k) for k in ("fused", "foreach")}
        o = run.cfg.optim
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=run.optimizer.param_groups[0]["lr"],
            momentum=o.momentum,
            nesterov=o.nesterov,
            weight_decay=o.weight_decay,
            **{k: v for k, v in flags.items() if v is not None},
        )
        if compiled:
            model = torch.compile(model)
        bare = BareLoop(model, optimizer, data, s.batch, run.amp_dtype, device, layout)
        out = {
            "optimizer_flags": flags,
            "engine_amp": str(run.amp_dtype),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,  # the engine's set-up sets
            "float32_matmul_precision": torch.get_float32_matmul_precision(),  # both globally
        }
        out["engine_first_step_s"] = round(timed(bench, lambda: engine_steps(run, 1)), 2)
        out["bare_first_step_s"] = round(timed(bench, lambda: bare.steps(1)), 2)
        engine_steps(run, s.warmup_steps)
        bare.steps(s.warmup_steps)
        step_s = timed(bench, lambda: engine_steps(run, 2)) / 2
        steps = segment_steps(bench, step_s, "resnet50_synthetic")
        out["segment_steps"] = steps
        out["budget_tight"] = bench.tight("resnet50_synthetic")
        engine, plain, engine_mem, bare_mem = [], [], [], []
        before = dynamo_snapshot()
        for k in range(s.segments):
            reset_peak(device)
            engine.append(steps * s.batch / timed(bench, lambda: engine_steps(run, steps)))
            engine_mem.append(peak_memory_gb(device))
            reset_peak(device)
            plain.append(steps * s.batch / timed(bench, lambda: bare.steps(steps)))
            bare_mem.append(peak_memory_gb(device))
            if k >= 1 and bench.remaining() < 0.5 * bench.planned_rest("imagenet_jpeg"):
                out["note"] = f"stopped after {k + 1} segments: the budget is short"
                break
        after = dynamo_delta(before, dynamo_snapshot())
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


def last_record(run) -> dict | None:
    records = [r for r in run.tracker.records if r.get("kind") == "train"]
    if not records:
        return None
    keep = ("step", "samples_per_s", "data_wait", "mfu", "gpu_mem_gb")
    return {k: records[-1][k] for k in keep if k in records[-1]}


def resnet50_synthetic(bench: Bench) -> dict:
    s = bench.sizes
    cfg, _ = load_config("imagenet", [f"model.arch={s.arch}", "model.num_classes=1000"])
    flops = train_flops_per_sample("imagenet", cfg.model, (3, s.image, s.image))
    peak, peak_source = peak_flops(bench.device)
    out = {
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
        bench, "(a) eager", lambda: resnet_pair(bench, False, flops, peak), need_s=bench.need(20)
    )
    out["compiled"] = attempt(
        bench,
        "(a) torch.compile",
        lambda: resnet_pair(bench, True, flops, peak),
        need_s=bench.need(100),
    )
    ok = [m for m in ("compiled", "eager") if out[m]["status"] == "ok"]
    if not ok:
        return out | {"status": "error", "error": "neither pair ran (see eager and compiled)"}
    best = ok[0]
    bench.cache["synthetic"] = {m: out[m]["engine"]["img_per_s"] for m in ok}
    out["headline"] = {
        "mode": best,
        "engine_img_per_s": out[best]["engine"]["img_per_s"],
        "bare_img_per_s": out[best]["bare"]["img_per_s"],
        "engine_over_bare": out[best]["engine_over_bare"],
        "meets_3500": min(out[best]["engine"]["img_per_s"], out[best]["bare"]["img_per_s"]) >= 3500,
        "meets_ratio_0.95": out[best]["engine_over_bare"] >= 0.95,
    }
    return out


# ---------------------------------------------------------------- (b) ImageNet JPEG folder


def _write_part(job: tuple) -> None:
    from bench.jpegs import write_jpeg_folder

    root, classes, per_class, seed = job
    write_jpeg_folder(Path(root), classes, per_class, 1, seed)


def jpeg_folder(bench: Bench) -> dict:
    """unique JPEGs written in parallel (one folder per process, then merged), each linked
    `links` times under train/: an epoch long enough for the timed steps."""
    if "jpeg" in bench.cache:
        return bench.cache["jpeg"]
    s = bench.sizes
    started = time.perf_counter()
    procs = max(1, min(cpu_count(), 16))
    per_class = max(1, math.ceil(s.jpeg_unique / (procs * s.jpeg_classes)))
    parts = bench.tmp / "jpeg-parts"
    jobs = [(str(parts / f"p{w}"), s.jpeg_classes, per_class, 1000 + w) for w in range(procs)]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(procs) as pool:
        pool.map(_write_part, jobs)
    root = bench.tmp / "imagenet-jpeg"
    unique = linked = 0
    for w in range(procs):
        for split in ("train", "val"):
            for class_dir in sorted((parts / f"p{w}" / split).iterdir()):
                target = root / split / class_dir.name
                target.mkdir(parents=True, exist_ok=True)
                for file in sorted(class_dir.iterdir()):
                    copies = s.jpeg_links if split == "train" else 1
                    unique += split == "train"
                    for r in range(copies):
                        os.link(file, target / f"{file.stem}_p{w}_r{r}{file.suffix}")
                        linked += split == "train"
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


def jpeg_run(bench: Bench, decode: str, compile_on: bool, synthetic: float | None) -> dict:
    s = bench.sizes
    folder = jpeg_folder(bench)
    if not has_key("imagenet", "data.decode"):
        if decode == "gpu":
            raise Skip("this checkout's imagenet data config has no data.decode (GPU decode)")
        decode_override = []
    else:
        decode_override = [f"data.decode={decode}"]
    workers = max(1, cpu_count() - 1)
    overrides = resnet_overrides(bench, compile_on) + decode_override
    overrides += [
        "model.num_classes=1000",  # (a)'s model: the same work per image, and its compiled graph
        f"data.root={folder['root']}",
        f"data.index_cache={bench.tmp / 'index-cache'}",
        f"loader.num_workers={workers}",
        f"log.every_steps={s.jpeg_window}",
    ]
    run = engine_run(bench, "imagenet", overrides, f"b-{decode}")
    try:
        needed = s.jpeg_warmup_steps + (1 + s.jpeg_windows) * s.jpeg_window
        if run.sampler.steps_per_epoch < needed:
            raise RuntimeError(
                f"an epoch of {run.sampler.steps_per_epoch} steps is shorter than the "
                f"{needed} steps this measurement needs; raise jpeg_links"
            )
        warm = timed(bench, lambda: engine_steps(run, s.jpeg_warmup_steps))
        # A second iterator: its first window (the workers refilling their queues) is dropped,
        # so the timed windows see the loader's steady state, not batches decoded while the
        # first steps compiled.
        first_timed = run.state.step + s.jpeg_window
        windows = s.jpeg_windows // (2 if bench.tight("imagenet_jpeg") else 1)
        wall = timed(bench, lambda: engine_steps(run, (1 + windows) * s.jpeg_window))
        records = [
            r for r in run.tracker.records if r.get("kind") == "train" and r["step"] > first_timed
        ]
        if not records:
            raise RuntimeError("the engine wrote no metrics records in the timed windows")
        samples = s.jpeg_window * s.batch
        seconds = [samples / r["samples_per_s"] for r in records]
        rate = len(records) * samples / sum(seconds)
        wait = sum(r["data_wait"] * t for r, t in zip(records, seconds, strict=True)) / sum(seconds)
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
    out = {
        "folder": {k: v for k, v in jpeg_folder(bench).items() if k != "root"},
        "compared_with": f"(a) engine, {'compiled' if compile_on else 'eager'}: "
        + (f"{reference} img/s" if reference else "not measured"),
        "target": {"gpu_decode_over_synthetic": TARGETS["jpeg_gpu_decode_over_synthetic"]},
    }
    out["cpu_decode"] = attempt(
        bench,
        "(b) CPU decode",
        lambda: jpeg_run(bench, "cpu", compile_on, reference),
        need_s=bench.need(25),
    )
    out["gpu_decode"] = attempt(
        bench,
        "(b) GPU decode",
        lambda: jpeg_run(bench, "gpu", compile_on, reference),
        need_s=bench.need(25),
    )
    gpu = out["gpu_decode"]
    if gpu["status"] == "ok" and "over_synthetic_engine" in gpu:
        out["meets_0.90"] = gpu["over_synthetic_engine"] >= 0.90
    return out


# ---------------------------------------------------------------- (c) CIFAR-10 fast, (d) recompiles


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


def cifar10_fast(bench: Bench) -> dict:
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
        spe = run.sampler.steps_per_epoch
        budget_steps = run.cfg.train.max_steps
        out |= {"batch": run.cfg.train.batch_size, "steps_per_epoch": spe}
        out |= {"budget_steps": budget_steps, "budget_epochs": round(budget_steps / spe, 2)}
        out["first_epoch_s"] = round(timed(bench, lambda: engine_steps(run, spe)), 3)
        epochs = 1 if bench.tight("cifar10_fast") else s.cifar_epochs
        times = [timed(bench, lambda: engine_steps(run, spe)) for _ in range(epochs)]
        epoch_s = median(times)
        progress = Progress(1, run.state.step, "off", False)
        eval_first = timed(bench, lambda: run_eval(run, progress))
        eval_s = timed(bench, lambda: run_eval(run, progress))
        flops = train_flops_per_sample("cifar10", run.cfg.model, (3, 32, 32))
        peak, _ = peak_flops(bench.device)
        out |= {
            "epoch_s": round(epoch_s, 4),
            "epochs_s": [round(t, 4) for t in times],
            "budget_tight": epochs < s.cifar_epochs,
            "step_ms": round(1000 * epoch_s / spe, 3),
            "projected_budget_s": round(budget_steps * epoch_s / spe, 3),
            "eval_first_s": round(eval_first, 3),
            "eval_s": round(eval_s, 3),
            "projected_budget_with_final_eval_s": round(budget_steps * epoch_s / spe + eval_s, 3),
            # what a fresh process takes: the first epoch and evaluation compile
            "projected_cold_start_s": round(
                out["first_epoch_s"] + (budget_steps - spe) * epoch_s / spe + eval_first, 3
            ),
            "img_per_s": round(spe * run.cfg.train.batch_size / epoch_s, 1),
            "train_mflops_per_img": round(flops / 1e6, 2),
            "mfu": mfu(spe * run.cfg.train.batch_size / epoch_s, flops, peak),
            "reference": REFERENCES[2],
        }
    finally:
        close_run(run)
    out["real_data"] = attempt(
        bench, "(c) real CIFAR-10", lambda: cifar_real(bench), need_s=bench.need(60)
    )
    return out


def cifar_real(bench: Bench) -> dict:
    from recipes.cifar10 import cifar_files

    cfg, _ = load_config("cifar10", [], "fast")
    try:
        cifar_files.require(Path(cfg.data.root))
    except Exception:
        raise Skip(
            "no CIFAR-10 files at the recipe's data.root ($RECIPES_DATA/cifar10 or "
            "data/cifar10): time to the end and top-1 not measured"
        ) from None
    overrides = [*bench.sizes.cifar_overrides, *bench.sizes.cifar_real_overrides]
    started = time.perf_counter()
    run = engine_run(bench, "cifar10", overrides, "c-fast-real", variant="fast")
    try:
        from engine.train import fit

        setup_s = time.perf_counter() - started
        bench.sync()
        seconds = timed(bench, lambda: fit(run))
        last = run.state.last_eval
        return {
            "data": "the files at the recipe's data.root",
            "setup_s": round(setup_s, 2),
            "fit_s": round(seconds, 2),
            "fit_note": "the engine's fit(): training, an evaluation and a checkpoint after "
            "every epoch, the first compilation included",
            "steps": run.state.step,
            "top1": last.get("top1"),
            "top5": last.get("top5"),
        }
    finally:
        close_run(run)


def compile_recompiles(bench: Bench) -> dict:
    """Recompilations over the phases a compiled run goes through."""
    root = cifar_folder(bench)
    overrides = [f"data.root={root}", *bench.sizes.cifar_overrides, "train.compile=on"]
    # Forget what (c) compiled: dynamo keys its cache on code, so the same network would run
    # on (c)'s graphs (inductor's on-disk cache still makes the compilations quick).
    torch._dynamo.reset()
    run = engine_run(bench, "cifar10", overrides, "d-recompiles", variant="fast")
    try:
        spe, batch = run.sampler.steps_per_epoch, run.sampler.plan.global_batch
        progress = Progress(1, 0, "off", False)
        phases = []

        def phase(name, fn):
            before = dynamo_snapshot()
            seconds = timed(bench, fn)
            counts = {"frames_compiled": 0, "graphs": 0, "recompiles": 0, "graph_breaks": 0}
            counts |= dynamo_delta(before, dynamo_snapshot())
            phases.append({"phase": name, "seconds": round(seconds, 2)} | counts)

        start = dynamo_snapshot()
        phase("train, first 3 steps", lambda: engine_steps(run, 3))
        run.state.position = max(run.state.position, (spe - 2) * batch)  # near the epoch's end
        phase("train across the epoch boundary (4 steps)", lambda: engine_steps(run, 4))
        phase("evaluation (the engine's run_eval)", lambda: run_eval(run, progress))
        phase("train after evaluation (3 steps)", lambda: engine_steps(run, 3))
        phase("evaluation again", lambda: run_eval(run, progress))
        total = dynamo_delta(start, dynamo_snapshot())
        if not start:
            raise RuntimeError("torch._dynamo counters are not readable in this torch")
        return {
            "run": "CIFAR-10 fast variant, train.compile=on",
            "eval_batches": math.ceil(len(run.eval_data) / run.cfg.eval.batch_size),
            "recompiles": total.get("recompiles", 0),
            "graph_breaks": total.get("graph_breaks", 0),
            "frames_compiled": total.get("frames_compiled", 0),
            "graphs": total.get("graphs", 0),
            "total": total or "no compilation at all",
            "phases": phases,
            "how_counted": "recompiles: dynamo's 'Recompiling function' log records "
            "(torch._logging recompiles artifact); graph breaks, frames and graphs: "
            "torch._dynamo.utils.counters",
        }
    finally:
        close_run(run)


# ---------------------------------------------------------------- (f) gpt, (e) memory and MFU


def gpt(bench: Bench) -> dict:
    if "gpt" not in R.available():
        return {"status": "not present", "reason": "recipes/gpt does not exist in this checkout"}
    return attempt(bench, "(f) gpt", lambda: gpt_measure(bench), need_s=bench.need(20))


def gpt_setup(variant: str, batch: int, seq: int | None):
    """The variant's model config and memory.py's Setup for `batch` sequences of `seq` tokens."""
    from recipes.gpt import memory

    plan = memory.load(variant)
    return dataclasses.replace(plan, micro_batch=batch, seq_len=seq or plan.seq_len)


def gpt_estimate(plan) -> dict:
    """recipes/gpt/memory.py's estimate for this micro batch on one GPU (its DDP column), GiB."""
    from recipes.gpt import memory

    rows = memory.estimate(plan, gpus=1)["ddp"]
    return {k: round(v / 2**30, 3) for k, v in rows.items()}


def gpt_model(recipe, cfg, device: torch.device):
    """Built on the meta device, given storage on `device`, each parameter filled by the
    recipe's init_weights from a generator seeded by its name (engine/parallel/weights.py's
    scheme, drawn on the device rather than the CPU: other values, the same distributions)."""
    from engine.seeding import derive_seed

    with torch.device("meta"):
        model = recipe.build_model(dataclasses.replace(cfg))
    model.to_empty(device=device)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        generator = torch.Generator(device=device)
        generator.manual_seed(derive_seed(0, zlib.crc32(name.encode())))
        recipe.init_weights(cfg, name, tensor, generator)
    return model


class GptLoop:
    """The recipe's training step without the engine: next-byte cross entropy on random bytes
    under bf16 autocast, backward, gradient clipping at 1.0, AdamW."""

    def __init__(self, model, forward, batch: int, seq: int, device: torch.device):
        self.forward, self.device = forward, device
        self.params = list(model.parameters())
        matrices = [p for p in self.params if p.dim() >= 2]
        others = [p for p in self.params if p.dim() < 2]
        self.flags = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
            lr=6e-4,
            betas=(0.9, 0.95),
            **self.flags,
        )
        gen = torch.Generator(device=device).manual_seed(0)
        pool = torch.randint(0, 256, (4, batch, seq + 1), generator=gen, device=device)
        # separate tensors: every step's input has the same strides and storage offset
        self.x = [chunk[:, :-1].contiguous() for chunk in pool]
        self.y = [chunk[:, 1:].contiguous() for chunk in pool]
        self.k = 0
        self.loss = None

    def steps(self, n: int) -> None:
        for _ in range(n):
            i = self.k % len(self.x)
            self.k += 1
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logits = self.forward(self.x[i])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.y[i].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.loss = loss.detach()


def gpt_train(
    bench: Bench,
    plan,
    checkpointing: bool,
    compiled: bool,
    steps: int | None = None,
    warmup: int | None = None,
) -> dict:
    """Train `plan`'s model on one device; time `steps` steps after the first and `warmup`
    more (steps None: as many as fill gpt_segment_s). Memory: the high-water mark of the
    timed steps, and what stays allocated between steps (weights, AdamW's moments)."""
    from engine.parallel.activations import checkpoint_blocks
    from recipes.gpt.model import flops_per_token

    s, device = bench.sizes, bench.device
    batch, seq = plan.micro_batch, plan.seq_len
    recipe = R.load("gpt")
    model = gpt_model(recipe, plan.model, device)
    if checkpointing:
        checkpoint_blocks(recipe.blocks(model))
    forward = torch.compile(model) if compiled else model
    loop = GptLoop(model, forward, batch, seq, device)
    try:
        out = {
            "activation_checkpointing": checkpointing,
            "compiled": compiled,
            "optimizer_flags": loop.flags,
        }
        out["first_step_s"] = round(timed(bench, lambda: loop.steps(1)), 3)
        loop.steps(s.gpt_warmup_steps if warmup is None else warmup)
        if steps is None:
            step_s = timed(bench, lambda: loop.steps(2)) / 2
            lo, hi = s.gpt_steps
            aim = s.gpt_segment_s / (2 if bench.tight("gpt") else 1)
            steps = int(min(hi, max(lo, round(aim / max(step_s, 1e-6)))))
            out["budget_tight"] = bench.tight("gpt")
        bench.sync()
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        reset_peak(device)
        seconds = timed(bench, lambda: loop.steps(steps))
        tokens_per_s = steps * batch * seq / seconds
        peak, _ = peak_flops(device)
        flops = flops_per_token(plan.model, seq)
        out |= {
            "timed_steps": steps,
            "step_ms": round(1000 * seconds / steps, 2),
            "tokens_per_s": round(tokens_per_s, 1),
            "mfu": mfu(tokens_per_s, flops, peak),
            "peak_step_gib": peak_memory_gb(device),
            "last_loss": round(float(loop.loss), 4),  # ~ln 256 = 5.55 on random bytes
        }
        if device.type == "cuda":
            out["resident_gib"] = round(resident / 2**30, 3)
            out["peak_step_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
        return out
    finally:
        forward = loop = model = None  # free the device memory before the next part
        if compiled:
            torch._dynamo.reset()  # its graphs hold the model's tensors


def gpt_memory_part(bench: Bench, plan, checkpointing: bool, estimate: dict) -> dict:
    """gpt_train at a fixed step count, its high-water mark against the estimate; running out
    of memory is a result here, not an error."""
    key = "total_ckpt" if checkpointing else "total"
    try:
        out = gpt_train(
            bench, plan, checkpointing, False, steps=bench.sizes.gpt_memory_steps, warmup=0
        )
    except torch.cuda.OutOfMemoryError as err:
        message = " ".join(str(err).split())[:600]
    else:
        out["estimate_gib"] = estimate[key]
        if out.get("peak_step_gib") is not None:
            out["measured_over_estimate"] = round(out["peak_step_gib"] / estimate[key], 3)
        return out
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "status": "out of memory",
        "activation_checkpointing": checkpointing,
        "error": message,
        "estimate_gib": estimate[key],
    }


def gpt_measure(bench: Bench) -> dict:
    from recipes.gpt.model import flops_per_token, parameter_count

    s, device = bench.sizes, bench.device
    started = time.perf_counter()
    share = s.gpt_share_s

    def part(label: str, fn, need_s: float) -> dict:
        """attempt(), started only while the block's share of the budget has room for it."""
        need_s = bench.need(need_s)
        left = share - (time.perf_counter() - started)
        if left < need_s:
            return {
                "status": "skipped",
                "reason": f"needs ~{need_s:.0f} s, {max(left, 0):.0f} s left of the gpt "
                f"block's {share:.0f} s",
            }
        return attempt(bench, label, fn, need_s=need_s)

    peak, peak_source = peak_flops(device)
    speed_setup = gpt_setup(s.gpt_speed_variant, s.gpt_speed_batch, s.gpt_seq)
    memory_setup = gpt_setup(s.gpt_memory_variant, s.gpt_memory_batch, s.gpt_seq)
    out = {
        "data": "random bytes (0-255) resident on the device, 4 batches in turn",
        "step": "bf16 autocast forward, fp32 cross entropy, backward, clip_grad_norm 1.0, "
        "AdamW (fused on CUDA), zero_grad(set_to_none=True); one device, no engine loop",
        "peak": peak_source,
        "flops_note": "recipes.gpt.model.flops_per_token: 6 x non-embedding parameters + "
        "12 x n_layer x d_model x T (attention), per trained token",
        "memory_note": "peak_step_gib: torch.cuda.max_memory_allocated over the timed steps "
        "(after the first, so AdamW's moments exist); resident_gib: allocated between steps; "
        "the estimate leaves out the logits, the CUDA context and allocator fragmentation",
    }
    cfgs = {}
    for key, plan in (("speed", speed_setup), ("memory", memory_setup)):
        m = plan.model
        cfgs[key] = {
            "variant": s.gpt_speed_variant if key == "speed" else s.gpt_memory_variant,
            "parameters": parameter_count(m),
            "n_layer": m.n_layer,
            "d_model": m.d_model,
            "n_head": m.n_head,
            "micro_batch": plan.micro_batch,
            "seq_len": plan.seq_len,
            "tokens_per_step": plan.micro_batch * plan.seq_len,
            "flops_per_token": flops_per_token(m, plan.seq_len),
            "estimate_gib": gpt_estimate(plan),
        }
    speed, memory = cfgs["speed"], cfgs["memory"]
    out["speed"], out["memory"] = speed, memory
    speed["eager"] = part(
        "(f) gpt speed, eager", lambda: gpt_train(bench, speed_setup, False, False), 12
    )
    speed["eager_checkpointing"] = part(
        "(f) gpt speed, eager, activation checkpointing",
        lambda: gpt_train(bench, speed_setup, True, False),
        10,
    )
    estimate = memory["estimate_gib"]
    memory["checkpointing"] = part(
        "(f) gpt memory, activation checkpointing",
        lambda: gpt_memory_part(bench, memory_setup, True, estimate),
        12,
    )
    memory["no_checkpointing"] = part(
        "(f) gpt memory, no activation checkpointing",
        lambda: gpt_memory_part(bench, memory_setup, False, estimate),
        10,
    )
    # Last: compilation is the longest and least predictable part.
    speed["compiled"] = part(
        "(f) gpt speed, torch.compile", lambda: gpt_train(bench, speed_setup, False, True), 40
    )
    ran = [k for k in ("compiled", "eager") if speed[k].get("status") == "ok"]
    if ran:
        best = speed[ran[0]]
        out["headline"] = {
            "mode": ran[0],
            "tokens_per_s": best["tokens_per_s"],
            "mfu": best["mfu"],
            "peak_step_gib": best["peak_step_gib"],
        }
    parts = [speed[k] for k in ("eager", "eager_checkpointing", "compiled")]
    parts += [memory[k] for k in ("checkpointing", "no_checkpointing")]
    if all(p.get("status") == "error" for p in parts):
        return out | {"status": "error", "error": "every gpt part failed (see each)"}
    return out


def memory_and_mfu(bench: Bench) -> dict:
    """One table of every path's memory high-water mark and MFU."""
    rows = []

    def walk(value, path):
        if not isinstance(value, dict):
            return
        if "img_per_s" in value or "tokens_per_s" in value:  # a path with a throughput
            row = {"measurement": path}
            for key in ("img_per_s", "tokens_per_s", "mfu", "peak_memory_gb"):
                row[key] = value.get(key)
            rows.append(row)
        for k, v in value.items():
            if isinstance(v, dict) and k not in ("sizes", "torch_compile", "reference", "headline"):
                walk(v, f"{path}.{k}")

    for name, entry in bench.result["measurements"].items():
        walk(entry, name)
    peak, source = peak_flops(bench.device)
    out = {"peak": source, "rows": rows}
    if bench.device.type != "cuda":
        out["note"] = "CPU: no GPU memory high-water mark and no MFU"
    return out


# ---------------------------------------------------------------- main

RUNNERS = {
    "resnet50_synthetic": resnet50_synthetic,
    "imagenet_jpeg": imagenet_jpeg,
    "cifar10_fast": cifar10_fast,
    "compile_recompiles": compile_recompiles,
}


def run_all(bench: Bench, only: set[str] | None) -> None:
    results = bench.result["measurements"]
    for name in MEASUREMENTS:
        bench.measurement = name
        if only and name not in only:
            results[name] = {"status": "skipped", "reason": "not selected (--only)"}
        elif name == "gpt":
            results[name] = gpt(bench)
        elif name == "memory_and_mfu":
            results[name] = attempt(
                bench, "(e) memory and MFU", lambda: memory_and_mfu(bench), memory=False
            )
        else:
            need = 5.0 if bench.smoke else min(30.0, dict(bench.sizes.planned_s)[name] / 4)
            results[name] = attempt(bench, name, lambda n=name: RUNNERS[n](bench), need_s=need)
        bench.measurement = ""
        bench.write()


def summary(bench: Bench) -> list[str]:
    m = bench.result["measurements"]
    a_model = m.get("resnet50_synthetic", {}).get("model", "resnet")
    lines = [
        f"GPU benchmark ({bench.result['mode']}), {bench.result['versions'].get('gpu', 'CPU')}"
    ]

    def get(entry, *keys):
        for k in keys:
            if not isinstance(entry, dict) or k not in entry:
                return None
            entry = entry[k]
        return entry

    a = m.get("resnet50_synthetic", {})
    for mode in ("eager", "compiled"):
        e, b = get(a, mode, "engine", "img_per_s"), get(a, mode, "bare", "img_per_s")
        if e is not None:
            ratio = get(a, mode, "engine_over_bare")
            lines.append(
                f"  (a) {a_model} {mode:8s} engine {e:8.1f} img/s, bare {b:8.1f} img/s "
                f"(target >= 3500); engine/bare {ratio:.3f} (target >= 0.95)"
            )
        else:
            lines.append(f"  (a) {mode}: {get(a, mode, 'status') or a.get('status')}")
    for decode in ("cpu_decode", "gpu_decode"):
        entry = get(m, "imagenet_jpeg", decode)
        if isinstance(entry, dict) and entry.get("status") == "ok":
            over = entry.get("over_synthetic_engine")
            target = " (target >= 0.90)" if decode == "gpu_decode" else ""
            lines.append(
                f"  (b) JPEG {decode:10s} {entry['img_per_s']:8.1f} img/s, data wait "
                f"{entry['data_wait_fraction']:.1%}, over synthetic "
                f"{'n/a' if over is None else f'{over:.3f}'}{target}"
            )
        elif isinstance(entry, dict):
            lines.append(f"  (b) JPEG {decode}: {entry.get('status')} {entry.get('reason', '')}")
    c = m.get("cifar10_fast", {})
    if c.get("status") == "ok":
        lines.append(
            f"  (c) CIFAR-10 fast: {c['epoch_s']:.3f} s/epoch, projected {c['projected_budget_s']:.2f}"
            f" s for {c['budget_steps']} steps (airbench94: 3.83 s on an A100)"
        )
    d = m.get("compile_recompiles", {})
    if d.get("status") == "ok":
        lines.append(f"  (d) recompiles {d['recompiles']}, graph breaks {d['graph_breaks']}")
    f = m.get("gpt", {})
    for key in ("eager", "eager_checkpointing", "compiled"):
        e = get(f, "speed", key)
        if isinstance(e, dict) and e.get("status") == "ok":
            lines.append(
                f"  (f) gpt {f['speed']['variant']} {key:19s} {e['tokens_per_s']:10.0f} tok/s, "
                f"MFU {fmt(e['mfu'], '.3f')}, peak {fmt(e['peak_step_gib'], '.2f')} GiB"
            )
        elif isinstance(e, dict):
            lines.append(f"  (f) gpt {key}: {e.get('status')} {e.get('reason', '')}")
    for key in ("checkpointing", "no_checkpointing"):
        e = get(f, "memory", key)
        if isinstance(e, dict) and "estimate_gib" in e:
            lines.append(
                f"  (f) gpt {f['memory']['variant']} {key:17s} peak "
                f"{fmt(e.get('peak_step_gib'), '.2f')} GiB ({e['status']}), estimate "
                f"{e['estimate_gib']:.2f} GiB (recipes/gpt/memory.py, 1 GPU)"
            )
        elif isinstance(e, dict):
            lines.append(f"  (f) gpt memory {key}: {e.get('status')} {e.get('reason', '')}")
    for name, entry in m.items():
        if entry.get("status") not in ("ok", None):
            lines.append(
                f"  {name}: {entry['status']} {entry.get('reason') or entry.get('error', '')}"
            )
    return lines


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    smoke_env = os.environ.get("GPU_BENCH_SMOKE", "").lower() in ("1", "true", "yes")
    parser.add_argument("--smoke", action="store_true", default=smoke_env)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--budget", type=float, default=None, help="seconds (default 440)")
    parser.add_argument("--batch", type=int, default=None, help="ResNet batch (default 256)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--only", default="", help="comma-separated measurement names")
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = float(os.environ.get("GPU_BENCH_BUDGET_S") or (300 if args.smoke else 440))
    if args.out is None:
        if os.environ.get("OUT"):
            args.out = Path(os.environ["OUT"]) / "gpu.json"
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            args.out = REPO / "runs" / "bench" / f"gpu-{stamp}.json"
    unknown = set(filter(None, args.only.split(","))) - set(MEASUREMENTS)
    if unknown:
        parser.error(f"unknown measurement(s) {sorted(unknown)}; choose from {MEASUREMENTS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    sizes = SMOKE if args.smoke else Sizes()
    if device.type == "cpu" and args.smoke:
        sizes = dataclasses.replace(sizes, compile_backend="eager")
    if args.batch:
        sizes = dataclasses.replace(sizes, batch=args.batch)
    bench = Bench(args, sizes, device, args.out)
    bench.say(f"{bench.result['mode']} run on {device}, budget {args.budget:.0f} s -> {args.out}")
    if device.type == "cpu" and not args.smoke:
        bench.note("full sizes on a CPU: expect the budget to cut most measurements short")
    try:
        bench.result["versions"] = versions(device)
    except Exception as err:
        bench.result["versions"] = error_entry(err) | {"python": platform.python_version()}
    use_compile_backend(sizes.compile_backend)
    if sizes.compile_backend:
        bench.note(
            f"torch.compile used the '{sizes.compile_backend}' backend (smoke on CPU): dynamo's "
            "capture, guards and recompilations ran, inductor's code generation did not"
        )
    watch_recompiles()
    bench.write()
    start_watchdog(bench)
    only = set(filter(None, args.only.split(","))) or None
    try:
        run_all(bench, only)
    finally:
        bench.write(final=True)
        shutil.rmtree(bench.tmp, ignore_errors=True)
    for line in summary(bench):
        print(line)
    print(f"results: {bench.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
