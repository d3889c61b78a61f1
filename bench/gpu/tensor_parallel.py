"""(g) tensor_parallel: the gpt recipe's `124m` variant on two GPUs of this machine, through
the engine under torchrun, as FSDP over both (dist.tp=1) and as one tensor-parallel group
(dist.tp=2): tokens/s of the last metrics window of each, and their ratio (tp=2 over tp=1),
both measured in this run. Skipped, with the reason, on a machine with fewer than two GPUs:
tensor parallelism needs at least two.

The same global batch (16 sequences of 1024 bytes, bf16, compile off: tensor parallelism
does not compile yet) and the same steps; the runs start from the same weights. What tp=2
changes: every block's matrices are split over the two GPUs (two all-gathers and two
reduce-scatters per block and pass, over NVLink or PCIe), where FSDP gathers each block
whole and splits the batch instead."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from bench.gpu.harness import REPO, Bench, Skip, attempt

STEPS = 12
LAYOUTS = {"tp1": ["dist.tp=1"], "tp2": ["dist.tp=2"]}


def tensor_parallel(bench: Bench) -> dict:
    gpus = torch.cuda.device_count() if bench.device.type == "cuda" else 0
    if gpus < 2:
        raise Skip(f"{gpus} GPU(s) here: tp=2 against tp=1 needs two")
    results = {}
    for name, overrides in LAYOUTS.items():
        results[name] = attempt(
            bench,
            f"tensor_parallel.{name}",
            f"(g) tensor parallel {name}",
            lambda o=overrides, n=name: one_layout(bench, n, o),
            need_s=40,
        )
    speeds = [results[n].get("tokens_per_s") for n in LAYOUTS]
    if all(speeds):
        return {"tp2_over_tp1": round(speeds[1] / speeds[0], 3)}
    return {}


def one_layout(bench: Bench, name: str, overrides: list[str]) -> dict:
    """Two processes under torchrun, the last window's tokens/s from the run's metrics."""
    root = bench.tmp / "tensor_parallel"
    steps = 3 if bench.smoke else STEPS
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "engine.train",
        "gpt",
        "--config",
        "124m",
        "log.wandb=off",
        "log.progress=plain",
        "device=cuda",
        f"run.root={root}",
        f"run.name={name}",
        f"train.max_steps={steps}",
        f"log.every_steps={steps // 2}",
        "train.batch_size=16",
        "train.micro_batch_size=8",
        "train.compile=off",
        "dist.strategy=fsdp",
        *overrides,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{name}: the run exited {done.returncode}: {tail}")
    lines = (root / "gpt" / name / "metrics.jsonl").read_text().splitlines()
    train = [json.loads(line) for line in lines if '"kind": "train"' in line]
    return {"tokens_per_s": train[-1]["tokens_per_s"], "steps": steps}


def summary(entry: dict) -> list[str]:
    if not entry:
        return []
    if entry.get("status") == "skipped":
        return [f"(g) tensor parallel: skipped ({entry.get('reason', '')})"]
    ratio = entry.get("tp2_over_tp1")
    speeds = {n: (entry.get(n) or {}).get("tokens_per_s") for n in LAYOUTS}
    said = ", ".join(f"{n} {v:,.0f} tokens/s" for n, v in speeds.items() if v)
    return [
        f"(g) tensor parallel, gpt 124m on 2 GPUs: {said}" + (f"; tp2/tp1 {ratio}" if ratio else "")
    ]
