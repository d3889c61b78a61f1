"""The training loop: step, epoch and fit.

`python -m engine.train RECIPE [key=value ...]` is the command line (engine.cli); one process
from start to summary is engine.lifecycle. A run is assembled by engine.assemble; evaluation,
metering and checkpoints live in engine.evaluate, engine.meter and engine.checkpoint.state."""

from __future__ import annotations

import json
import runpy
import time

import torch

from engine import checkpoint as ckpt
from engine import distributed as D
from engine import hang, preempt
from engine import parallel as P
from engine.checkpoint import state as checkpoint_state
from engine.data.stages import STAGES
from engine.ema import update_ema
from engine.evaluate import run_eval
from engine.faults import RunError, inject_after_step, slow_data
from engine.meter import Meter
from engine.optim import grad_norm_
from engine.profile import Profiling, phase
from engine.run import Run
from engine.tracking import ProgressBar, log

# ---------------------------------------------------------------- one step


def train_step(run: Run, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro batches; returns the summed loss and the
    gradient norm (both detached, on the device: reading them would sync the host)."""
    accum = len(micro_batches)
    scale = run.denv.dp_size / global_count(run, micro_batches)
    smoothing = run.cfg.train.label_smoothing
    total, device = None, run.device
    for j, batch in enumerate(micro_batches):
        x, y = run.to_device(batch.x, batch.y, run.feed.train_data)
        if run.feed.mix is not None:
            x, y = run.feed.mix(x, y, run.progress.epoch, micro_position(run, j))
        sync = P.gradient_sync(run.net.model, run.net.strategy, last=j == accum - 1)
        with sync, STAGES.device_time("forward_backward", device):
            with run.autocast(), phase("forward"):
                # DDP and FSDP average gradients over the data-parallel ranks: x their
                # count / global count makes the step's gradient that of the loss summed
                # over the global batch divided by its count, for any world size, tensor
                # parallel split and accumulation.
                loss = run.task.train_loss(run.net.model(x), y, smoothing) * scale
            if injected_nan(run):
                loss = loss * float("nan")
            with phase("backward"):
                run.opt.scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    with phase("optimizer"), STAGES.device_time("optimizer", device):
        norm = gradient_norm(run)
        if apply_step(run, norm):
            run.opt.scaler.step(run.opt.optimizer)
        run.opt.scaler.update()
        run.opt.optimizer.zero_grad(set_to_none=True)
        run.opt.scheduler.step()  # the schedule follows the step count, skipped steps included
        update_ema(run.net.ema, run.net.bare, run.progress.step + 1, run.cfg.ema)
    return total, norm


def global_count(run: Run, micro_batches: list) -> float | torch.Tensor:
    """The units the step's loss is normalised by, over all ranks and micro batches: the
    global batch for a per-sample task (no communication), else the targets' count summed
    over the ranks (e.g. tokens not ignored; a collective, on the device, without sync)."""
    counts = [run.task.count(b.y) for b in micro_batches]
    if counts[0] is None:
        return float(run.feed.sampler.plan.global_batch)
    total = torch.stack(counts).sum().to(run.device, torch.float32).reshape(1)
    return D.all_reduce_sum(total).clamp(min=1).reshape(())


def micro_position(run: Run, j: int) -> int:
    """The epoch position of micro batch j's first sample: the same for any world size."""
    plan = run.feed.sampler.plan
    return run.progress.position + run.denv.dp_rank * plan.per_rank + j * plan.micro_batch


def injected_nan(run: Run) -> bool:
    fault = run.cfg.fault
    return fault.nan_at_step == run.progress.step + 1 and run.denv.rank == fault.rank


def gradient_norm(run: Run) -> torch.Tensor:
    """The total norm of the (unscaled, all-reduced) gradients, clipped when configured."""
    if run.opt.scaler.is_enabled():
        run.opt.scaler.unscale_(run.opt.optimizer)
    params = [p for p in run.net.trainable if p.grad is not None]
    norm = grad_norm_(params, run.cfg.train.grad_clip, run.net.plain)
    if run.net.strategy.shards:  # a DTensor over the shards: the norm of all of them
        norm = norm.full_tensor()
    return norm.detach()


def apply_step(run: Run, norm: torch.Tensor) -> bool:
    """Whether to take the optimizer step. fp16: the scaler skips non-finite steps itself.
    nan_policy=skip reads the norm (one host sync per step); stop takes the step and keeps
    the norm: the norms since the last check are checked together, on the device, before
    each log record and checkpoint (note_bad_steps), and read back there."""
    if run.opt.scaler.is_enabled():
        return True
    if run.cfg.train.nan_policy != "skip":
        run.health.unchecked_norms.append(norm)
        return True
    if torch.isfinite(norm).item():
        return True
    run.health.skipped_steps += 1
    log(f"warning: non-finite gradients at step {run.progress.step + 1}; step skipped")
    return False


# ---------------------------------------------------------------- epochs


def train_epoch(run: Run, bar: ProgressBar) -> str | None:
    """Train to the end of the epoch; returns a reason when training must stop early."""
    cfg, st, plan = run.cfg, run.progress, run.feed.sampler.plan
    run.feed.sampler.set_epoch(st.epoch, st.position)
    meter = Meter(run.device)
    batches = iter(run.feed.loader)  # the batch sampler is read in this process, at iter()
    epoch_end = run.feed.epoch_samples()
    profiling = run.held.profiling
    while st.position < epoch_end and st.step < st.total_steps:
        if profiling is not None:
            profiling.step_begins(st.step + 1)
        micro = take_batches(run, batches, meter)
        hang.beat("step", st.step + 1)  # the watchdog's marks: no system call
        stepped = time.perf_counter()
        loss, norm = train_step(run, micro)
        meter.step += time.perf_counter() - stepped
        st.step += 1
        hang.beat("after step", st.step)
        st.position += plan.global_batch
        meter.add(loss, norm, plan.global_batch)
        if profiling is not None:
            profiling.step_ended(st.step)
        record = log_window(run, meter) if st.step % cfg.log.every_steps == 0 else None
        bar.update(st.step, record)
        reason = stop_reason(run)
        every = cfg.ckpt.every_steps
        if reason or (every and st.step % every == 0 and st.position < epoch_end):
            saving = time.perf_counter()
            checkpoint(run)
            meter.checkpoint += time.perf_counter() - saving
        if reason:
            return reason
    return None


def take_batches(run: Run, batches, meter: Meter) -> list:
    """The step's micro batches from the loader (the time blocked here is the window's data
    wait), noted where asked: their sample ids, their replaced samples."""
    waited = time.perf_counter()
    with phase("data wait"):
        micro = [next(batches) for _ in range(run.feed.sampler.plan.accum_steps)]
        slow_data(run.cfg.fault)
    meter.wait += time.perf_counter() - waited
    meter.add_work(micro)
    if run.cfg.log.sample_ids:
        write_sample_ids(run, micro)
    run.health.note_replaced(micro)
    return micro


def log_window(run: Run, meter: Meter) -> dict:
    """The logging window's record (a collective: the loss and the replaced-sample count
    summed over ranks), written; a non-finite step stops the run here. One host sync: the
    loss, that count, the gradient norm and the non-finite flag are read back together."""
    run.health.note_bad_steps(run.progress.step)
    summed = meter.loss.detach().clone().reshape(1)
    if run.health.skip_bad:  # filled on the device from a host int: no copy from Python data
        summed = torch.cat([summed, summed.new_full((1,), float(run.health.pending_bad))])
    D.all_reduce_sum(summed)
    norm, bad = meter.grad_norm.detach(), run.health.first_bad_step != 0
    local = torch.stack([norm.to(summed.dtype), bad.to(summed.dtype)])
    synced = time.perf_counter()
    loss, *rest = torch.cat([summed, local]).tolist()  # waits for the device's queue
    meter.sync += time.perf_counter() - synced
    *count, grad_norm, bad = rest
    if bad:
        check_finite(run)
    if count:
        run.health.add_replaced(int(count[0]))
    record = meter.record(run, loss, grad_norm)
    run.records.tracker.write(record)
    return record


def stop_reason(run: Run) -> str | None:
    inject_after_step(run.cfg.fault, run.progress.step, run.denv.rank)
    hang.beat("stop check", run.progress.step)  # before the agreement's collective
    stop_at = run.cfg.train.stop_at_step
    if stop_at and run.progress.step == stop_at and run.progress.step < run.progress.total_steps:
        return "stop_at_step"
    # Ranks agree on a preemption with a collective, at the steps where metrics are reduced
    # anyway: one more per step would cost a device sync on every step.
    if run.progress.step % run.cfg.log.every_steps == 0 and D.any_rank(
        preempt.stop_requested(), run.device
    ):
        return "preempted"
    return None


def write_sample_ids(run: Run, micro: list) -> None:
    ids = torch.cat([b.index for b in micro]).tolist()
    gathered = D.gather_objects(ids, data=True)
    if run.denv.is_main:
        with (run.run_dir / "samples.jsonl").open("a") as f:
            f.write(
                json.dumps({"step": run.progress.step, "ids": sorted(sum(gathered, []))}) + "\n"
            )


def train_steps(run: Run, steps: int, bar: ProgressBar | None = None) -> None:
    """`steps` more optimizer steps through the loop, crossing epoch ends as fit() does but
    without its evaluations and checkpoints: the step API of benchmarks and tests."""
    st = run.progress
    st.total_steps = st.step + steps
    bar = bar or ProgressBar(st.total_steps, st.step, "off", False)
    while st.step < st.total_steps:
        reason = train_epoch(run, bar)
        if reason:
            raise RunError(f"training stopped early at step {st.step}: {reason}")
        if st.position >= run.feed.epoch_samples():
            st.next_epoch()


def fit(run: Run) -> str | None:
    cfg, st = run.cfg, run.progress
    bar = ProgressBar(st.total_steps, st.step, cfg.log.progress, run.denv.is_main)
    profiling = Profiling(cfg.prof, run.denv.rank, run.denv.world_size, run.run_dir, run.device)
    run.held.profiling = profiling if profiling.active else None
    try:
        while st.step < st.total_steps:
            reason = train_epoch(run, bar)
            if reason:
                return reason
            if st.position >= run.feed.epoch_samples():
                end_epoch(run, bar)
        last = run.records.last_eval
        if not last or last.get("step") != st.step:
            run.records.last_eval = run_eval(run, bar)
            checkpoint(run)
        return None
    finally:
        bar.close()
        if run.held.profiling is not None:
            run.held.profiling.close()
            run.held.profiling = None


def end_epoch(run: Run, bar: ProgressBar) -> None:
    st = run.progress
    st.next_epoch()
    if st.epoch % run.cfg.eval.every_epochs == 0 or st.step >= st.total_steps:
        run.records.last_eval = run_eval(run, bar)
    checkpoint(run)


def checkpoint(run: Run) -> None:
    """Save the run (a collective), never weights that took a non-finite step."""
    hang.beat("checkpoint", run.progress.step)
    check_finite(run)
    run.health.sum_replaced(run.device)
    checkpoint_state.save(run)


def check_finite(run: Run) -> None:
    """nan_policy=stop: never checkpoint (or go on from) weights that took a non-finite step."""
    run.health.note_bad_steps(run.progress.step)
    bad = int(run.health.first_bad_step.item())
    if not bad:
        return
    newest = ckpt.list_checkpoints(run.run_dir / "checkpoints")
    kept = f"the last good checkpoint is {newest[0]}" if newest else "no checkpoint was saved"
    raise RunError(
        f"non-finite gradients at step {bad}; stopped without saving ({kept}). Continue from "
        f"it, skipping such steps, with run.name={run.cfg.run.name} train.nan_policy=skip, or "
        "start a new run with a lower optim.lr or train.grad_clip"
    )


if __name__ == "__main__":
    # `python -m engine.train` is the documented command; the command line is engine.cli
    # (run as a module, not imported: the loop never depends on its command line).
    runpy.run_module("engine.cli", run_name="__main__", alter_sys=True)
