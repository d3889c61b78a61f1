"""determinism: whether the engine's training is bitwise repeatable on this device, with
deterministic=true (engine.seeding.set_deterministic, as engine.lifecycle.train applies it). Two
identical short runs of the imagenet recipe on synthetic data (ResNet-18, `determinism_steps`
steps: one epoch, then the engine's evaluation and checkpoint, through the engine's fit()),
and a third stopped halfway (train.stop_at_step, which checkpoints) and resumed from that
checkpoint by a new engine run of the same name. Each part, eager and torch.compile'd,
records whether the final weights (the bare model's state dict, buffers included) are equal
bitwise, run against run and whole against stop/resume, and the largest absolute
difference. Process-wide settings that deterministic=true changes are restored afterwards.

cuBLAS's workspace setting (CUBLAS_WORKSPACE_CONFIG, which set_deterministic sets when unset)
is read when torch first creates a cuBLAS handle, earlier in this process; it matters for
determinism only across several streams, and these runs train on one."""

from __future__ import annotations

import contextlib
import os

import torch

from bench.gpu.engine_runs import close_run, engine_run
from bench.gpu.harness import Bench, Skip, attempt, get
from engine.hardware import deterministic_flags
from engine.seeding import set_deterministic
from engine.train import fit


@contextlib.contextmanager
def deterministic_mode():
    """set_deterministic(True) for the block; the previous process-wide flags afterwards."""
    algorithms = torch.are_deterministic_algorithms_enabled()
    cudnn = torch.backends.cudnn.deterministic
    set_deterministic(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(algorithms)
        torch.backends.cudnn.deterministic = cudnn


def run_overrides(bench: Bench, compiled: bool) -> list[str]:
    s = bench.sizes
    return [
        *s.determinism_overrides,
        "deterministic=true",
        f"train.compile={'on' if compiled else 'off'}",
        f"train.batch_size={s.determinism_batch}",
        f"eval.batch_size={s.determinism_batch}",
        f"train.max_steps={s.determinism_steps}",
        "loader.num_workers=0",
        "data.synthetic=true",
        f"data.synthetic_train={s.determinism_batch * s.determinism_steps}",  # one epoch
        f"data.synthetic_val={s.determinism_batch}",
    ]


def fit_weights(bench: Bench, name: str, overrides: list[str]) -> tuple[dict, str | None]:
    """An engine run through fit(): its final weights (on the CPU) and fit's stop reason."""
    run = engine_run(bench, "imagenet", overrides, name)
    try:
        reason = fit(run)
        weights = {k: v.detach().cpu().clone() for k, v in run.net.bare.state_dict().items()}
        return weights, reason
    finally:
        close_run(run)


def compare(a: dict, b: dict) -> dict:
    """equal: every tensor bitwise the same; max_abs_diff over the floating ones."""
    if a.keys() != b.keys():
        return {"equal": False, "max_abs_diff": None, "note": "different tensor names"}
    equal = all(torch.equal(a[k], b[k]) for k in a)
    diffs = [
        (a[k].double() - b[k].double()).abs().max().item()
        for k in a
        if a[k].is_floating_point() and a[k].numel()
    ]
    return {"equal": equal, "max_abs_diff": max(diffs, default=0.0)}


def determinism_part(bench: Bench, compiled: bool) -> dict:
    mode = "compiled" if compiled else "eager"
    overrides = run_overrides(bench, compiled)
    stop_at = bench.sizes.determinism_steps // 2
    with deterministic_mode():
        first, _ = fit_weights(bench, f"det-{mode}-a", overrides)
        flags = deterministic_flags()  # as the engine's set-up left them for its runs
        second, _ = fit_weights(bench, f"det-{mode}-b", overrides)
        halves = f"det-{mode}-halves"
        _, reason = fit_weights(bench, halves, [*overrides, f"train.stop_at_step={stop_at}"])
        if reason != "stop_at_step":
            raise RuntimeError(f"the first half stopped with {reason!r}, not at step {stop_at}")
        resumed, _ = fit_weights(bench, halves, overrides)  # resume=auto: its checkpoint
    return {
        "compiled": compiled,
        "steps": bench.sizes.determinism_steps,
        "stopped_and_resumed_at": stop_at,
        "flags": flags,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "two_runs": compare(first, second),
        "stop_resume": compare(first, resumed),
    }


def made(bench: Bench, compiled: bool) -> bool:
    """True where the sizes make this mode's runs; else Skip, with the reason."""
    if compiled and not bench.sizes.determinism_compiled:
        raise Skip("this run's sizes leave the compiled runs out (a smoke run: eager only)")
    return True


def determinism(bench: Bench) -> dict:
    out = bench.entry("determinism")  # in the JSON from the start, the parts with it
    out["recipe"] = "imagenet, synthetic data, " + " ".join(bench.sizes.determinism_overrides)
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        attempt(
            bench,
            f"determinism.{mode}",
            f"determinism, {mode}",
            lambda c=compiled: made(bench, c) and determinism_part(bench, c),
            need_s=bench.need(8 if not compiled else 15),
        )
    return {}


def summary(entry: dict) -> list[str]:
    lines = []
    for mode in ("eager", "compiled"):
        e = get(entry, mode)
        if not isinstance(e, dict):
            continue
        if e.get("status") != "ok":
            lines.append(f"  determinism {mode}: {e.get('status')} {e.get('reason', '')}".rstrip())
            continue
        two, resume = e["two_runs"], e["stop_resume"]
        lines.append(
            f"  determinism {mode:8s} two runs equal {two['equal']} (max diff "
            f"{two['max_abs_diff']:.3g}), stop/resume equal {resume['equal']} (max diff "
            f"{resume['max_abs_diff']:.3g})"
        )
    return lines
