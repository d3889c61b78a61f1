"""Metering a logging window: loss, gradient norm, throughput, the share of time spent waiting
for data, and the figures derived from throughput (units/s, MFU, GPU memory)."""

from __future__ import annotations

import time

import torch

from engine import config as C
from engine.data.stages import STAGES, WORKER_STAGES
from engine.parts.records import Speed
from engine.recipe import Recipe
from engine.run import Run
from engine.speed import flops_per_sample, gpu_memory_gb, peak_flops
from engine.tracking import log

# a train record's values that the clock decides, not the training: they differ between two
# runs that are otherwise bitwise the same (units per second, "<unit>_per_s", too)
CLOCKED = (
    *("samples_per_s", "data_wait", "mfu", "gpu_mem_gb", "step_s", "to_device", "step_host"),
    *("sync", "checkpoint", "decode", "augment", "finish_thread", "gpu_data_wait"),
    *("forward_backward", "optimizer", "gpu_util", "gpu_power_w"),
)


def clocked(key: str) -> bool:
    return key in CLOCKED or key.endswith("_per_s")


def speed_inputs(recipe: Recipe, cfg: C.Config, device: torch.device, world_size: int) -> Speed:
    """The devices' peak and the FLOPs per sample (the recipe's declared count, else counted);
    counted only where a peak is known (no MFU on CPU), so a run without one spends no
    start-up time on them."""
    units = recipe.units_per_sample(cfg.data) if recipe.units_per_sample else 0
    peak = peak_flops(cfg.log.peak_tflops, device) * world_size
    if not peak:
        return Speed(units_per_sample=units)
    if recipe.flops_per_sample:
        flops = recipe.flops_per_sample(cfg.model, cfg.data)
    else:
        flops = flops_per_sample(recipe, cfg)
    return Speed(flops_per_sample=flops, peak_flops=peak, units_per_sample=units)


class Meter:
    """Loss, throughput and data-wait fraction over a logging window. The loss and norm stay
    on the device until the window is recorded: reading them would sync the host each step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.windows = 0  # log windows recorded so far
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.steps = self.samples = 0
        self.wait = self.step = self.sync = self.checkpoint = 0.0  # seconds: see breakdown()
        self.work: torch.Tensor | None = None  # loader workers' seconds per WORKER_STAGES
        self.work_batches = 0
        STAGES.take()  # what ran before the window (an evaluation's batches) is not its
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, norm: torch.Tensor, samples: int) -> None:
        self.loss += loss
        self.grad_norm += norm
        self.steps += 1
        self.samples += samples

    def add_work(self, batches: list) -> None:
        """The seconds the loader workers spent loading these batches, where they say."""
        for batch in batches:
            work = getattr(batch, "work", None)
            if work is not None:
                self.work = work if self.work is None else self.work + work
                self.work_batches += 1

    def worker_figures(self) -> dict[str, float]:
        """worker_<stage>_s: the window's mean seconds of worker time per batch in each stage
        of loading its samples (read, decode, augment); nothing where no worker loaded."""
        if self.work is None:
            return {}
        means = (self.work / self.work_batches).tolist()
        return {f"worker_{stage}_s": v for stage, v in zip(WORKER_STAGES, means, strict=True)}

    def record(self, run: Run, loss_over_ranks: float, grad_norm: float) -> dict:
        """The window's record, given the window's loss summed over the ranks and its
        gradient norms summed (the same on every rank), both read by the caller at once."""
        loss = loss_over_ranks / run.denv.dp_size
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rec = {
            "kind": "train",
            "step": run.progress.step,
            "epoch": run.progress.epoch,
            "loss": loss / self.steps,
            "grad_norm": grad_norm / self.steps,
            "lr": run.opt.lr(),
            "samples_per_s": self.samples / elapsed,
            "data_wait": self.wait / elapsed,
            "step_s": elapsed / self.steps,
            **self.breakdown(elapsed),
            **self.worker_figures(),
        }
        rec |= speed_figures(run, rec["samples_per_s"])
        if run.health.skip_bad:
            rec["bad_samples"] = run.health.bad_samples
        if run.cfg.train.nan_policy == "skip":
            rec["skipped_steps"] = run.health.skipped_steps
        if self.windows > 0:  # the first window of an epoch includes the workers' start
            warn_if_starved(run, rec["data_wait"], slowest_worker_stage(rec))
        self.windows += 1
        self.reset()
        return rec

    def breakdown(self, elapsed: float) -> dict[str, float]:
        """Shares of the window's wall time. The training thread's, which with data_wait
        account for all but the loop's own bookkeeping (logging, the progress bar, stop
        checks): to_device (moving, and finishing on the device where no thread does it
        ahead), step_host (launching forward, backward and optimizer, less to_device), sync
        (waiting for the device when the window's results are read back), checkpoint
        (saving one within the window). The input
        pipeline's stages where this process ran them (engine.data.stages), on either
        thread: decode, augment, finish_thread (the thread finishing batches ahead, busy),
        gpu_data_wait (the training stream idle until a batch finished ahead was ready). The
        step's parts: forward_backward and optimizer, their device time (CUDA events; on the
        CPU the host's, which computes them). Gradient all-reduces overlap the backward pass
        and are not told apart from it."""
        stages = STAGES.take()
        to_device = stages.pop("to_device", 0.0)
        shares = {
            "to_device": to_device / elapsed,
            "step_host": max(self.step - to_device, 0.0) / elapsed,
            "sync": self.sync / elapsed,
            "checkpoint": self.checkpoint / elapsed,
        }
        return shares | {stage: seconds / elapsed for stage, seconds in sorted(stages.items())}


def speed_figures(run: Run, samples_per_s: float) -> dict:
    """The task's units per second where declared (tokens/s); MFU (achieved / peak FLOP/s of
    all devices) where both are known; rank 0's GPU memory high-water mark on CUDA."""
    out, speed = {}, run.records.speed
    if speed.units_per_sample:  # e.g. tokens_per_s
        out[f"{run.task.unit}_per_s"] = samples_per_s * speed.units_per_sample
    if speed.flops_per_sample and speed.peak_flops:
        out["mfu"] = samples_per_s * speed.flops_per_sample / speed.peak_flops
    memory = gpu_memory_gb(run.device)
    if memory is not None:
        out["gpu_mem_gb"] = memory
    return out | device_stats(run.device)


def device_stats(device: torch.device) -> dict[str, float]:
    """This rank's GPU as NVML reads it now: utilisation (0-1) and power (W); nothing where
    the device is not CUDA or NVML's Python binding (pynvml) is not installed."""
    if device.type != "cuda":
        return {}
    try:
        util = torch.cuda.utilization(device) / 100
        power = torch.cuda.power_draw(device) / 1000
    except Exception:  # noqa: BLE001 - no pynvml, or a device NVML does not read
        return {}
    return {"gpu_util": util, "gpu_power_w": power}


STAGE_WORDS = {"read": "reading files", "decode": "decoding", "augment": "augmenting"}


def slowest_worker_stage(rec: dict) -> str:
    """ ", its workers spend 78% of their time decoding" from a record's worker figures; ""
    where the record has none."""
    spent = {s: rec[f"worker_{s}_s"] for s in WORKER_STAGES if f"worker_{s}_s" in rec}
    total = sum(spent.values())
    if total <= 0:
        return ""
    stage = max(spent, key=spent.get)
    return f"; its workers spend {spent[stage] / total:.0%} of their time {STAGE_WORDS[stage]}"


def warn_if_starved(run: Run, data_wait: float, slowest: str = "") -> None:
    """Once per run: the loader, not the model, sets the pace (and, where the workers say,
    the stage of loading that takes them longest)."""
    if run.records.speed.warned_data_wait or data_wait <= run.cfg.log.data_wait_warn:
        return
    run.records.speed.warned_data_wait = True
    workers = run.cfg.loader.num_workers
    faster = f" or {run.recipe.faster_input}" if run.recipe.faster_input else ""
    log(
        f"warning: {data_wait:.0%} of the last {run.cfg.log.every_steps} steps waited for data "
        f"(rank {run.denv.rank}): the loader cannot keep the {run.device.type.upper()} busy"
        f"{slowest}. "
        f"Raise loader.num_workers (now {workers}){faster}, or put the data on faster storage"
    )
