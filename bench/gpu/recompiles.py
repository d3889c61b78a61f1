"""(d) compile_recompiles: torch.compile recompilations and graph breaks over training steps,
an epoch boundary and evaluation passes (the CIFAR-10 fast run), with the guard that
triggered each recompilation."""

from __future__ import annotations

import math

import torch

from bench.gpu.cifar10 import cifar_folder
from bench.gpu.compile_log import dynamo_delta, dynamo_snapshot
from bench.gpu.engine_runs import close_run, engine_run, engine_steps
from bench.gpu.harness import Bench, timed
from engine.tracking import ProgressBar
from engine.train import run_eval

NO_COMPILATION = {"frames_compiled": 0, "graphs": 0, "recompiles": 0, "graph_breaks": 0}


def phase(bench: Bench, phases: list, name: str, fn) -> None:
    """fn timed, with what dynamo compiled while it ran, appended to phases."""
    before = dynamo_snapshot()
    seconds = timed(bench, fn)
    counts = NO_COMPILATION | dynamo_delta(before, dynamo_snapshot())
    phases.append({"phase": name, "seconds": round(seconds, 2)} | counts)


def run_phases(bench: Bench, run) -> list[dict]:
    """Training, an epoch boundary, evaluation and training after it, evaluation again."""
    spe, batch = run.feed.sampler.steps_per_epoch, run.feed.sampler.plan.global_batch
    progress = ProgressBar(1, 0, "off", False)
    phases = []
    phase(bench, phases, "train, first 3 steps", lambda: engine_steps(run, 3))
    run.progress.position = max(run.progress.position, (spe - 2) * batch)  # near the epoch's end
    phase(bench, phases, "train across the epoch boundary (4 steps)", lambda: engine_steps(run, 4))
    phase(bench, phases, "evaluation (the engine's run_eval)", lambda: run_eval(run, progress))
    phase(bench, phases, "train after evaluation (3 steps)", lambda: engine_steps(run, 3))
    phase(bench, phases, "evaluation again", lambda: run_eval(run, progress))
    return phases


def compile_recompiles(bench: Bench) -> dict:
    """Recompilations over the phases a compiled run goes through."""
    root = cifar_folder(bench)
    overrides = [f"data.root={root}", *bench.sizes.cifar_overrides, "train.compile=on"]
    # Forget what (c) compiled: dynamo keys its cache on code, so the same network would run
    # on (c)'s graphs (inductor's on-disk cache still makes the compilations quick).
    torch._dynamo.reset()
    run = engine_run(bench, "cifar10", overrides, "d-recompiles", variant="fast")
    try:
        start = dynamo_snapshot()
        phases = run_phases(bench, run)
        total = dynamo_delta(start, dynamo_snapshot())
        if not start:
            raise RuntimeError("torch._dynamo counters are not readable in this torch")
        return {
            "run": "CIFAR-10 fast variant, train.compile=on",
            "eval_batches": math.ceil(len(run.feed.eval_data) / run.cfg.eval.batch_size),
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


def summary(entry: dict) -> list[str]:
    if entry.get("status") != "ok":
        return []
    return [f"  (d) recompiles {entry['recompiles']}, graph breaks {entry['graph_breaks']}"]
