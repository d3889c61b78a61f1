"""`python -m bench.gpu` (what bench/gpu.sh runs): the flags, the device and sizes, then every
measurement in order, the JSON written after each, and the summary printed at the end."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from bench.gpu import __doc__ as PACKAGE_DOC
from bench.gpu import (
    cifar10,
    decode_stages,
    determinism,
    gpt,
    jpeg,
    recompiles,
    resnet,
    tensor_parallel,
)
from bench.gpu.compile_log import use_compile_backend, watch_recompiles
from bench.gpu.harness import (
    REPO,
    Bench,
    attempt,
    error_entry,
    start_watchdog,
    summary_failures,
    summary_head,
)
from bench.gpu.memory_mfu import memory_and_mfu
from bench.gpu.sizes import BUDGET_S, MEASUREMENTS, SMOKE, SMOKE_BUDGET_S, Sizes, selectable
from bench.gpu.versions import versions

RUNNERS = {
    "resnet50_synthetic": resnet.resnet50_synthetic,
    "imagenet_jpeg": jpeg.imagenet_jpeg,
    "decode_stages": decode_stages.decode_stages,
    "cifar10_fast": cifar10.cifar10_fast,
    "compile_recompiles": recompiles.compile_recompiles,
    "determinism": determinism.determinism,
    "tensor_parallel": tensor_parallel.tensor_parallel,
}
SUMMARIES = {  # the printed summary's order: the run order, (e) in the JSON only
    "resnet50_synthetic": resnet.summary,
    "imagenet_jpeg": jpeg.summary,
    "decode_stages": decode_stages.summary,
    "cifar10_fast": cifar10.summary,
    "compile_recompiles": recompiles.summary,
    "determinism": determinism.summary,
    "gpt": gpt.summary,
    "tensor_parallel": tensor_parallel.summary,
}


def run_all(bench: Bench) -> None:
    """Each measurement in order; attempt() files it, and each of its parts, in the JSON."""
    results = bench.result["measurements"]
    for name in MEASUREMENTS:
        if name == "gpt":
            results[name] = gpt.gpt(bench)  # keeps to its own share of the budget
        elif name == "memory_and_mfu":
            attempt(bench, name, "(e) memory and MFU", lambda: memory_and_mfu(bench), memory=False)
        else:
            need = 5.0 if bench.smoke else min(30.0, dict(bench.sizes.planned_s)[name] / 4)
            attempt(bench, name, name, lambda n=name: RUNNERS[n](bench), need_s=need)
        bench.write()


def summary(bench: Bench) -> list[str]:
    m = bench.result["measurements"]
    lines = [summary_head(bench)]
    for name, lines_of in SUMMARIES.items():
        lines += lines_of(m.get(name, {}))
    return lines + summary_failures(m)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=PACKAGE_DOC.splitlines()[0]
    )
    smoke_env = os.environ.get("GPU_BENCH_SMOKE", "").lower() in ("1", "true", "yes")
    parser.add_argument("--smoke", action="store_true", default=smoke_env)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--budget", type=float, default=None, help=f"seconds (default {BUDGET_S:.0f})"
    )
    parser.add_argument("--batch", type=int, default=None, help="ResNet batch (default 256)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated measurements or parts, e.g. resnet50_synthetic.eager,gpt.speed",
    )
    args = parser.parse_args(argv)
    if args.budget is None:
        default = SMOKE_BUDGET_S if args.smoke else BUDGET_S
        args.budget = float(os.environ.get("GPU_BENCH_BUDGET_S") or default)
    if args.out is None:
        if os.environ.get("OUT"):
            args.out = Path(os.environ["OUT"]) / "gpu.json"
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            args.out = REPO / "runs" / "bench" / f"gpu-{stamp}.json"
    unknown = set(filter(None, args.only.split(","))) - set(selectable())
    if unknown:
        names = ", ".join(selectable())
        parser.error(f"--only: unknown {', '.join(sorted(unknown))}; valid names: {names}")
    return args


def pick_device(choice: str | None) -> torch.device:
    """The asked device, else the first GPU when there is one, else the CPU."""
    device = torch.device(choice or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    return device


def pick_sizes(args, device: torch.device) -> Sizes:
    sizes = SMOKE if args.smoke else Sizes()
    if device.type == "cpu" and args.smoke:
        # amp=auto: float32 on a CPU (bfloat16 there is emulated without AVX512-BF16, 3-5x
        # slower), bfloat16 on a GPU: the autocast lines run either way
        sizes = dataclasses.replace(sizes, compile_backend="eager", amp="auto")
    if args.batch:
        sizes = dataclasses.replace(sizes, batch=args.batch)
    return sizes


def prepare(bench: Bench) -> None:
    """Versions recorded, the compile backend chosen, recompilations logged."""
    if bench.device.type == "cpu" and not bench.smoke:
        bench.note("full sizes on a CPU: expect the budget to cut most measurements short")
    try:
        bench.result["versions"] = versions(bench.device)
    except Exception as err:
        bench.result["versions"] = error_entry(err) | {"python": platform.python_version()}
    backend = bench.sizes.compile_backend
    use_compile_backend(backend)
    if backend:
        bench.note(
            f"torch.compile used the '{backend}' backend (smoke on CPU): dynamo's "
            "capture, guards and recompilations ran, inductor's code generation did not; "
            f"ResNet precision amp={bench.sizes.amp} (float32 on a CPU)"
        )
    watch_recompiles()


# What bench/gpu.sh's wheels folder provides and the parts that need it: said before anything
# runs (here, not in the wrapper: one interpreter importing torch fewer, ~3 s of the budget).
OPTIONAL = {
    "torchcodec.decoders": "torchcodec (image decoding: imagenet_jpeg, decode_stages)",
    "airbench": "airbench (cifar10_fast.airbench94)",
}


def say_missing_packages() -> None:
    for module, what in OPTIONAL.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a broken wheel is as missing as an absent one
            print(
                f"gpu.sh: {what} is missing ({type(e).__name__}: {e}): make gpu-wheels "
                "fetches it into .gpu-wheels (or set GPU_BENCH_WHEELS)",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    say_missing_packages()
    args = parse_args(argv)
    device = pick_device(args.device)
    bench = Bench(args, pick_sizes(args, device), device, args.out)
    bench.say(f"{bench.result['mode']} run on {device}, budget {args.budget:.0f} s -> {args.out}")
    prepare(bench)
    bench.write()
    start_watchdog(bench)
    try:
        run_all(bench)
    finally:
        bench.write(final=True)
        shutil.rmtree(bench.tmp, ignore_errors=True)
    for line in summary(bench):
        print(line)
    print(f"results: {bench.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
