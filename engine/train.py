"""One training process: `python -m engine.train RECIPE [key=value ...] [--spawn N]`.

Exit codes: 0 done, 1 failure, 2 bad request (one line on stderr), 75 stopped on a
preemption signal with a checkpoint saved (rerun the same command to resume)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine import catalog as R
from engine import checkpoint as ckpt
from engine import config as C
from engine import distributed as D
from engine import parallel as P
from engine import preempt, rundir
from engine.data.loaders import eval_loader, train_loader
from engine.data.mix import BatchMix, build_mix
from engine.data.sampler import GlobalBatchSampler, plan_batches
from engine.ema import build_ema, ema_state, load_ema_state, update_ema
from engine.faults import RunError, inject_after_step, save_pause, slow_data
from engine.optim import build_optimizer, build_scheduler
from engine.parallel import weights
from engine.recipe import Recipe
from engine.seeding import derive_seed, rng_state, seed_process, set_deterministic, set_rng_state
from engine.speed import (
    flops_per_sample,
    gpu_memory_gb,
    memory_format,
    peak_flops,
    set_backend_flags,
)
from engine.tracking import (
    NullTracker,
    Progress,
    Tracker,
    environment,
    log,
    redact,
    wandb_mode,
)


@dataclass
class State:
    """Where training stands: enough, with the checkpointed states, to resume bit for bit."""

    epoch: int = 0
    step: int = 0  # optimizer steps done
    position: int = 0  # global samples consumed in the current epoch
    last_eval: dict = field(default_factory=dict)
    bad_samples: int = 0  # unreadable files replaced so far, summed over ranks (data.skip_bad)
    skipped_steps: int = 0  # optimizer steps skipped for non-finite gradients (nan_policy=skip)


@dataclass
class Run:
    cfg: C.Config
    denv: D.DistEnv
    device: torch.device
    run_dir: Path
    model: nn.Module  # wrapped for training (DDP/DP/compiled), sharded (FSDP) or bare
    bare: nn.Module  # the recipe's module (under FSDP: with sharded parameters)
    eval_model: nn.Module  # the bare model, compiled when training is
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: GlobalBatchSampler
    loader: torch.utils.data.DataLoader  # built once, so persistent workers persist
    train_data: torch.utils.data.Dataset
    eval_data: torch.utils.data.Dataset
    task: object  # what the loss and the evaluation metrics are (engine.tasks)
    total_steps: int
    amp_dtype: torch.dtype | None
    tracker: Tracker | NullTracker
    state: State
    ema: torch.optim.swa_utils.AveragedModel | None = None
    mix: BatchMix | None = None
    skip_bad: bool = False
    pending_bad: int = 0  # this rank's replaced samples not yet summed into state.bad_samples
    lock_fd: int | None = None  # rank 0's hold on the run directory, released when it exits
    # First step whose gradients were not finite (0: none), kept on the device so that the
    # check costs no host sync per step; read at log intervals and before every checkpoint.
    first_bad_step: torch.Tensor | None = None
    memory_format: torch.memory_format = torch.contiguous_format  # of 4-d input batches
    flops_per_sample: float = 0.0  # training FLOPs (forward + backward); 0: unknown
    peak_flops: float = 0.0  # of all devices together; 0: unknown (no MFU)
    warned_data_wait: bool = False
    trainable: list[nn.Parameter] = field(default_factory=list)  # the bare model's, listed once
    units_per_sample: int = 0  # the task's units (e.g. tokens) per sample; 0: not declared
    sharded_checkpoints: bool = False  # DCP directories (dist.strategy=fsdp)


# ---------------------------------------------------------------- configuration


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    if mode == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if mode == "fp16" and device.type != "cuda":
        raise C.ConfigError("train.amp=fp16 needs a CUDA device; use train.amp=bf16 or off on CPU")
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


# ---------------------------------------------------------------- set-up


def resume_source(cfg: C.Config, run_dir: Path) -> tuple[Path, dict] | None:
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        return ckpt.latest_valid(run_dir / "checkpoints")
    path = Path(cfg.resume)
    return path, ckpt.load(path)


def build_datasets(cfg: C.Config, recipe: Recipe):
    """Rank 0 first (it scans and caches file indexes; the others then read them), and the
    model's class count from the data when model.num_classes is 0."""
    train_data, eval_data = D.main_first(lambda: recipe.build_datasets(cfg.data))
    if getattr(cfg.model, "num_classes", None) == 0:
        classes = getattr(train_data, "classes", None)
        if not classes:
            raise C.ConfigError(
                "model.num_classes=0 follows the data, but this training set lists no "
                "classes; set model.num_classes"
            )
        cfg.model.num_classes = len(classes)
    return train_data, eval_data


def setup(cfg: C.Config, recipe: Recipe, denv: D.DistEnv, device: torch.device) -> Run:
    run_dir = Path(cfg.run.root) / cfg.recipe / cfg.run.name
    mode = "off" if not denv.is_main else wandb_mode(cfg.log)
    plan = plan_batches(cfg.train.batch_size, cfg.train.micro_batch_size, denv.world_size)
    dtype = amp_dtype(cfg.train.amp, device)
    if cfg.dist.strategy == "fsdp":
        P.check_fsdp(cfg.dist, device, dtype, cfg.ema.decay > 0)
    seed_process(cfg.seed, denv.rank)
    train_data, eval_data = build_datasets(cfg, recipe)
    model = weights.build(recipe, cfg.model)
    sampler = GlobalBatchSampler(len(train_data), plan, denv.rank, cfg.seed)
    total = cfg.train.max_steps or cfg.train.epochs * sampler.steps_per_epoch
    skip_bad = bool(getattr(cfg.data, "skip_bad", False))

    source = resume_source(cfg, run_dir)
    if source:
        check_config_drift(cfg, source, denv.is_main)
        check_format(cfg, denv, source[0])
    model, ema, wrapped, eval_model, layout = place_model(
        model, recipe, cfg, denv, device, plan.accum_steps, dtype, train_data, source
    )
    optimizer = build_optimizer(model, cfg.optim, cfg.train.batch_size, device)
    scheduler = build_scheduler(optimizer, total, cfg.sched, sampler.steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    state = State()
    if source:
        state = restore(source, model, optimizer, scheduler, scaler, denv, cfg.seed)
        if ema is not None:
            if "ema" not in source[1]:
                raise C.ConfigError(
                    f"checkpoint {source[0]} holds no EMA of the weights, but ema.decay is set; "
                    "resume with the config that wrote it (ema.decay=0) or start a new run"
                )
            load_ema_state(ema, source[1]["ema"])
        if denv.is_main:
            log(f"resuming from {source[0]} (epoch {state.epoch}, step {state.step})")

    lock_fd = D.on_main(lambda: claim_run_dir(cfg, run_dir))
    tracker = NullTracker()
    if denv.is_main:
        ckpt.atomic_write_text(run_dir / "config.yaml", redact(C.dump(cfg)))
        tracker = Tracker(run_dir, cfg.log, mode, cfg.to_dict(), state.step)
    hosts = D.gather_objects(D.host_name())
    if denv.is_main:
        env = environment(denv.world_size, hosts, device)
        ckpt.atomic_write_text(run_dir / "env.json", json.dumps(env, indent=2) + "\n")
    return Run(
        cfg,
        denv,
        device,
        run_dir,
        wrapped,
        model,
        eval_model,
        optimizer,
        scheduler,
        scaler,
        sampler,
        train_loader(train_data, sampler, cfg.loader, device, skip_bad),
        train_data,
        eval_data,
        recipe.task,
        total,
        dtype,
        tracker,
        state,
        ema=ema,
        mix=build_mix(cfg.mix, getattr(cfg.model, "num_classes", None), cfg.seed),
        skip_bad=skip_bad,
        lock_fd=lock_fd,
        first_bad_step=torch.zeros((), dtype=torch.long, device=device),
        memory_format=layout,
        trainable=[p for p in model.parameters() if p.requires_grad],
        units_per_sample=recipe.units_per_sample(cfg.data) if recipe.units_per_sample else 0,
        sharded_checkpoints=cfg.dist.strategy == "fsdp",
        **mfu_inputs(recipe, cfg, device, denv.world_size),
    )


def place_model(model, recipe, cfg, denv, device, accum_steps, dtype, train_data, source):
    """The model with its weights (prepared, initialised by name, or resumed from a single
    file) on the device, wrapped for training: (bare, EMA, train model, eval model, layout).
    Under FSDP a model on the meta device is sharded first and given storage after, so each
    process only ever holds its own shard; a sharded checkpoint is loaded later, with the
    optimizer (check_format refused a single file)."""
    from_file = source is not None and not source[0].is_dir()
    sharding = P.strategy_for(cfg.dist.strategy, denv) == "fsdp"
    if weights.on_meta(model) and not sharding:
        # unsharded: the whole model on every process anyway (DDP broadcasts it at wrap time)
        weights.initialise(model, recipe, cfg.model, cfg.seed, torch.device("cpu"))
    on_meta = weights.on_meta(model)
    if recipe.prepare and not source and not on_meta:  # a resumed run loads prepared weights
        recipe.prepare(model, train_data)
    if from_file and not on_meta:
        ckpt.load_model_state(model, source[1]["model"], source[0])
    set_backend_flags(cfg.train, cfg.deterministic)
    # FSDP2 shards only contiguous parameters: channels_last weights stay unsharded-only.
    layout = memory_format(model, cfg.train.channels_last and not sharding)
    if not on_meta:
        model = model.to(device, memory_format=layout)
    ema = None if on_meta else build_ema(model, cfg.ema)
    blocks = P.recipe_blocks(recipe, model, cfg)
    wrapped, eval_model = P.wrap(model, blocks, cfg, denv, device, accum_steps, dtype)
    if on_meta:
        storage = torch.device("cpu") if cfg.dist.cpu_offload else device
        weights.initialise(model, recipe, cfg.model, cfg.seed, storage)
        ema = build_ema(model, cfg.ema)
    return model, ema, wrapped, eval_model, layout


def check_format(cfg: C.Config, denv: D.DistEnv, path: Path) -> None:
    """A single-file checkpoint holds whole tensors keyed for one model: FSDP cannot take it
    (a sharded one loads anywhere)."""
    if path.is_dir() or P.strategy_for(cfg.dist.strategy, denv) != "fsdp":
        return
    raise C.ConfigError(
        f"checkpoint {path} is a single file (written without dist.strategy=fsdp) and cannot "
        "be loaded sharded; resume it with the strategy that wrote it (e.g. dist.strategy=ddp)"
    )


def mfu_inputs(recipe: Recipe, cfg: C.Config, device: torch.device, world_size: int) -> dict:
    """The devices' peak and the FLOPs per sample (the recipe's declared count, else counted);
    counted only where a peak is known (no MFU on CPU), so a run without one spends no
    start-up time on them."""
    peak = peak_flops(cfg.log.peak_tflops, device) * world_size
    if not peak:
        return {"peak_flops": 0.0, "flops_per_sample": 0.0}
    if recipe.flops_per_sample:
        return {
            "peak_flops": peak,
            "flops_per_sample": recipe.flops_per_sample(cfg.model, cfg.data),
        }
    return {"peak_flops": peak, "flops_per_sample": flops_per_sample(recipe, cfg)}


def claim_run_dir(cfg: C.Config, run_dir: Path) -> int:
    """Rank 0, after every check that can refuse the request and before the first write:
    lock the directory, move an overwritten run aside, clear a dead writer's partial files."""
    fd = rundir.acquire(run_dir)
    if cfg.resume == "none" and rundir.holds_a_run(run_dir):  # run.overwrite=true
        log(f"run.overwrite: the earlier run's files are now in {rundir.move_aside(run_dir)}")
    folder = run_dir / "checkpoints"
    folder.mkdir(exist_ok=True)
    for leftover in rundir.remove_partial_checkpoints(folder):
        log(f"removed {leftover.name}, a checkpoint whose writing was interrupted")
    return fd


def check_config_drift(cfg: C.Config, source: tuple[Path, dict], is_main: bool) -> None:
    """Resuming continues one run: a change that alters it (batch, optimizer, schedule, data,
    model, seed) is refused; one that keeps its guarantees (logging, evaluation, length,
    checkpointing, workers, process count) is allowed and said."""
    saved = source[1].get("config")
    if saved is None:  # written before checkpoints carried their config
        return
    refused, allowed = ckpt.config_changes(saved, redact(cfg.to_dict()))
    if refused:
        raise C.ConfigError(
            f"checkpoint {source[0]} was written with another config ({', '.join(refused)}); "
            "resuming would change the run it continues: go back to those values, or start a "
            "new run with another run.name"
        )
    if allowed and is_main:
        log(f"resuming with changed settings that keep the run's guarantees: {', '.join(allowed)}")


def restore(source, model, optimizer, scheduler, scaler, denv: D.DistEnv, seed: int) -> State:
    path, saved = source
    if path.is_dir():  # sharded: every rank reads the parts of the shards it now holds
        from engine.checkpoint import sharded  # seconds to import: only where used

        sharded.load(path, model, optimizer)
    else:
        optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    scaler.load_state_dict(saved["scaler"])
    if saved["world_size"] == denv.world_size:
        set_rng_state(saved["rng"][denv.rank])
    else:  # a different world size: fresh per-rank streams, still a function of the step
        seed_process(derive_seed(seed, saved["step"]), denv.rank)
    return State(
        saved["epoch"],
        saved["step"],
        saved["position"],
        saved.get("last_eval", {}),
        saved.get("bad_samples", 0),
        saved.get("skipped_steps", 0),
    )


# ---------------------------------------------------------------- checkpoint, evaluation


def save_checkpoint(run: Run) -> None:
    """A collective: every rank contributes its RNG state; rank 0 writes the single file (or
    every rank its shard), and every rank learns whether the checkpoint is complete (a failed
    write stops all of them, not one alone)."""
    check_finite(run)
    rngs = D.gather_objects(rng_state())
    flush_bad_count(run)
    if run.sharded_checkpoints:
        error = write_sharded_checkpoint(run, rngs)
    else:
        error = write_checkpoint(run, rngs) if run.denv.is_main else None
    if D.any_rank(error is not None, run.device):  # also the barrier: nobody leaves early
        raise RunError(error or "another rank could not write the checkpoint (see its error)")


def checkpoint_meta(run: Run, rngs: list) -> dict:
    """Everything in a checkpoint but the model and optimizer: position, schedule, RNGs."""
    st = run.state
    return {
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "epoch": st.epoch,
        "step": st.step,
        "position": st.position,
        "world_size": run.denv.world_size,
        "rng": rngs,
        "last_eval": st.last_eval,
        "bad_samples": st.bad_samples,
        "skipped_steps": st.skipped_steps,
        "config": redact(run.cfg.to_dict()),  # never a pasted credential
    }


def write_checkpoint(run: Run, rngs: list) -> str | None:
    """Rank 0: the checkpoint file, then pruning; the error line when the disk refuses."""
    folder = run.run_dir / "checkpoints"
    path = ckpt.checkpoint_path(folder, run.state.step)
    payload = checkpoint_meta(run, rngs) | {
        "model": run.bare.state_dict(),
        "optimizer": run.optimizer.state_dict(),
    }
    if run.ema is not None:
        payload["ema"] = ema_state(run.ema)
    try:
        ckpt.atomic_save(payload, path, save_pause(run.cfg.fault, run.state.step))
        ckpt.prune(folder, run.cfg.ckpt.keep, path)
    except OSError as err:
        return write_error(run, path, err)
    return None


def write_sharded_checkpoint(run: Run, rngs: list) -> str | None:
    """Every rank: its shard of the model and optimizer, in a directory that is renamed into
    place once all shards and the metadata are written; rank 0 prunes."""
    folder = run.run_dir / "checkpoints"
    path = ckpt.sharded_path(folder, run.state.step)
    pause = save_pause(run.cfg.fault, run.state.step)
    from engine.checkpoint import sharded  # seconds to import: only where used

    try:
        sharded.save(path, run.bare, run.optimizer, checkpoint_meta(run, rngs), pause)
        if run.denv.is_main:
            ckpt.prune(folder, run.cfg.ckpt.keep, path)
    except OSError as err:
        return write_error(run, path, err)
    return None


def write_error(run: Run, path: Path, err: OSError) -> str:
    folder = path.parent
    previous = [p.name for p in ckpt.list_checkpoints(folder) if p != path]
    intact = f"{previous[0]} is intact" if previous else "no earlier checkpoint exists"
    return (
        f"could not write checkpoint {path}: {err.strerror or err}; {intact}. Free space or "
        f"fix permissions under {run.run_dir.parent}, then rerun with "
        f"run.name={run.cfg.run.name} to resume"
    )


def check_finite(run: Run) -> None:
    """nan_policy=stop: never checkpoint (or go on from) weights that took a non-finite step."""
    bad = int(run.first_bad_step.item())
    if not bad:
        return
    newest = ckpt.list_checkpoints(run.run_dir / "checkpoints")
    kept = f"the last good checkpoint is {newest[0]}" if newest else "no checkpoint was saved"
    raise RunError(
        f"non-finite gradients at step {bad}; stopped without saving ({kept}). Continue from "
        f"it, skipping such steps, with run.name={run.cfg.run.name} train.nan_policy=skip, or "
        "start a new run with a lower optim.lr or train.grad_clip"
    )


def flush_bad_count(run: Run) -> None:
    """Sum the ranks' replaced-sample counts into the state (a collective with skip_bad)."""
    if not run.skip_bad:
        return
    pending = torch.tensor([float(run.pending_bad)], device=run.device)
    run.state.bad_samples += int(D.all_reduce_sum(pending).item())
    run.pending_bad = 0


def predict(run: Run, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits; a compiled model sees every batch at the full eval batch size (the last one
    padded), so a shard's shorter last batch costs no recompilation."""
    size = run.cfg.eval.batch_size
    if model is run.eval_model is not run.bare and len(x) < size:
        padding = x.new_zeros((size - len(x), *x.shape[1:]))
        x = torch.cat([x, padding]).contiguous(memory_format=run.memory_format)
    with autocast(run):
        logits = model(x)
        if run.cfg.eval.hflip_tta:  # the mirror image is as likely; average both views
            logits = (logits + model(x.flip(-1))) / 2
    return logits.float()


@torch.no_grad()
def evaluate(run: Run, model: nn.Module) -> dict:
    """Each held-out sample exactly once across ranks; the task's per-sample sums reduced
    over ranks, then divided by the summed count. A file that could not be read
    (data.skip_bad) is left out of the sums and counted as skipped."""
    device = run.device
    was_training = model.training
    model.eval()
    loader = eval_loader(
        run.eval_data,
        run.cfg.eval.batch_size,
        run.denv.rank,
        run.denv.world_size,
        run.cfg.loader,
        device,
        run.skip_bad,
    )
    names = [*run.task.metrics, "count"]
    totals = torch.zeros(len(names) + 2, dtype=torch.float64, device=device)  # + kept, skipped
    seen, x = [], None
    # FSDP gathers weights from all ranks in every forward pass: all make as many passes
    # as the rank with the most batches (agreed before the first pass; the extra ones are
    # thrown away).
    passes = D.max_over_ranks(len(loader), device) if P.is_sharded(model) else len(loader)
    for batch in loader:
        if run.cfg.log.sample_ids:
            seen += batch.index.tolist()
        x, y = to_device(batch.x, batch.y, run, run.eval_data)
        keep = (batch.replaced == 0).to(device)
        sums = run.task.eval_sums(predict(run, model, x)[: len(y)], y)
        kept = [sums[name].double()[keep].sum() for name in names]
        totals += torch.stack([*kept, keep.sum().double(), (~keep).sum().double()])
    for _ in range(passes - len(loader)):
        if x is None:  # this rank had no batch at all: any valid input will do
            x, _ = to_device(*first_sample(run), run, run.eval_data)
        predict(run, model, x)
    D.all_reduce_sum(totals)
    if run.cfg.log.sample_ids:
        write_ids(run, {"kind": "eval", "step": run.state.step, "ids_by_rank": seen})
    *sums, count, samples, skipped = totals.tolist()
    if int(samples + skipped) != len(run.eval_data):
        raise RuntimeError(f"evaluated {int(samples)} samples, expected {len(run.eval_data)}")
    model.train(was_training)
    result = {
        name: value / max(count, 1) for name, value in zip(run.task.metrics, sums, strict=True)
    }
    result |= run.task.derived(result)
    result["count"] = int(count)
    return result | ({"skipped": int(skipped)} if run.skip_bad else {})


def first_sample(run: Run):
    x, y = run.eval_data[0]
    return x.unsqueeze(0), torch.as_tensor(y).unsqueeze(0)


# ---------------------------------------------------------------- the loop


def autocast(run: Run):
    if run.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(run.device.type, dtype=run.amp_dtype)


def to_device(x, y: torch.Tensor, run: Run, dataset):
    """The batch on the device, in the model's memory format. A dataset may finish its batches
    there (`finish_on_device`: uint8 images normalised, or JPEG bytes decoded, on the device)."""
    finish = getattr(dataset, "finish_on_device", None)
    x = finish(x, run.device) if finish else x.to(run.device, non_blocking=True)
    if x.ndim == 4:
        x = x.contiguous(memory_format=run.memory_format)
    return x, y.to(run.device, non_blocking=True)


def micro_position(run: Run, j: int) -> int:
    """The epoch position of micro batch j's first sample: the same for any world size."""
    plan = run.sampler.plan
    return run.state.position + run.denv.rank * plan.per_rank + j * plan.micro_batch


def train_step(run: Run, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro batches; returns the summed loss and the
    gradient norm (both detached, on the device: reading them would sync the host)."""
    accum = len(micro_batches)
    scale = run.denv.world_size / global_count(run, micro_batches)
    smoothing = run.cfg.train.label_smoothing
    total = torch.zeros((), device=run.device)
    for j, batch in enumerate(micro_batches):
        x, y = to_device(batch.x, batch.y, run, run.train_data)
        if run.mix is not None:
            x, y = run.mix(x, y, run.state.epoch, micro_position(run, j))
        with P.gradient_sync(run.model, last=j == accum - 1):
            with autocast(run):
                # DDP and FSDP average gradients over ranks: x world size / global count
                # makes the step's gradient that of the loss summed over the global batch
                # divided by its count, for any world size and accumulation.
                loss = run.task.train_loss(run.model(x), y, smoothing) * scale
            if injected_nan(run):
                loss = loss * float("nan")
            run.scaler.scale(loss).backward()
        total += loss.detach()
    norm = gradient_norm(run)
    if apply_step(run, norm):
        run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()  # the schedule follows the step count, skipped steps included
    update_ema(run.ema, run.bare, run.state.step + 1, run.cfg.ema)
    return total, norm


def global_count(run: Run, micro_batches: list) -> float | torch.Tensor:
    """The units the step's loss is normalised by, over all ranks and micro batches: the
    global batch for a per-sample task (no communication), else the targets' count summed
    over the ranks (e.g. tokens not ignored; a collective, on the device, without sync)."""
    counts = [run.task.count(b.y) for b in micro_batches]
    if counts[0] is None:
        return float(run.sampler.plan.global_batch)
    total = torch.stack(counts).sum().to(run.device, torch.float32).reshape(1)
    return D.all_reduce_sum(total).clamp(min=1).reshape(())


def injected_nan(run: Run) -> bool:
    fault = run.cfg.fault
    return fault.nan_at_step == run.state.step + 1 and run.denv.rank == fault.rank


def gradient_norm(run: Run) -> torch.Tensor:
    """The total norm of the (unscaled, all-reduced) gradients, clipped when configured."""
    if run.scaler.is_enabled():
        run.scaler.unscale_(run.optimizer)
    params = [p for p in run.trainable if p.grad is not None]
    # foreach: one batched norm kernel (by default CPU tensors get one norm call each)
    if run.cfg.train.grad_clip > 0:
        norm = nn.utils.clip_grad_norm_(params, run.cfg.train.grad_clip, foreach=True)
    else:
        norm = nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if hasattr(norm, "full_tensor"):  # a DTensor (sharded gradients): the norm of all shards
        norm = norm.full_tensor()
    return norm.detach()


def apply_step(run: Run, norm: torch.Tensor) -> bool:
    """Whether to take the optimizer step. fp16: the scaler skips non-finite steps itself.
    nan_policy=skip reads the norm (one host sync per step); stop only records the first bad
    step on the device, read back at log intervals and before each checkpoint."""
    if run.scaler.is_enabled():
        return True
    if run.cfg.train.nan_policy == "skip":
        if torch.isfinite(norm).item():
            return True
        run.state.skipped_steps += 1
        log(f"warning: non-finite gradients at step {run.state.step + 1}; step skipped")
        return False
    bad = ~torch.isfinite(norm) & (run.first_bad_step == 0)
    run.first_bad_step = torch.where(bad, run.state.step + 1, run.first_bad_step)
    return True


class Meter:
    """Loss, throughput and data-wait fraction over a logging window."""

    def __init__(self, device: torch.device):
        self.device = device
        self.windows = 0  # log windows recorded so far
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.steps = self.samples = 0
        self.wait = 0.0
        self.started = time.perf_counter()

    def record(self, run: Run) -> dict:
        loss = D.all_reduce_sum(self.loss.detach().clone().reshape(1)).item() / run.denv.world_size
        check_finite(run)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        st = run.state
        flush_bad_count(run)
        rec = {
            "kind": "train",
            "step": st.step,
            "epoch": st.epoch,
            "loss": loss / self.steps,
            "grad_norm": self.grad_norm.item() / self.steps,  # the same on every rank
            "lr": run.optimizer.param_groups[0]["lr"],
            "samples_per_s": self.samples / elapsed,
            "data_wait": self.wait / elapsed,
        }
        rec |= speed_figures(run, rec["samples_per_s"])
        if run.skip_bad:
            rec["bad_samples"] = st.bad_samples
        if run.cfg.train.nan_policy == "skip":
            rec["skipped_steps"] = st.skipped_steps
        if self.windows > 0:  # the first window of an epoch includes the workers' start
            warn_if_starved(run, rec["data_wait"])
        self.windows += 1
        self.reset()
        return rec


def speed_figures(run: Run, samples_per_s: float) -> dict:
    """The task's units per second where declared (tokens/s); MFU (achieved / peak FLOP/s of
    all devices) where both are known; rank 0's GPU memory high-water mark on CUDA."""
    out = {}
    if run.units_per_sample:  # e.g. tokens_per_s
        out[f"{run.task.unit}_per_s"] = samples_per_s * run.units_per_sample
    if run.flops_per_sample and run.peak_flops:
        out["mfu"] = samples_per_s * run.flops_per_sample / run.peak_flops
    memory = gpu_memory_gb(run.device)
    if memory is not None:
        out["gpu_mem_gb"] = memory
    return out


def warn_if_starved(run: Run, data_wait: float) -> None:
    """Once per run: the loader, not the model, sets the pace."""
    if run.warned_data_wait or data_wait <= run.cfg.log.data_wait_warn:
        return
    run.warned_data_wait = True
    workers = run.cfg.loader.num_workers
    decode = " or data.decode=gpu" if hasattr(run.cfg.data, "decode") else ""
    log(
        f"warning: {data_wait:.0%} of the last {run.cfg.log.every_steps} steps waited for data "
        f"(rank {run.denv.rank}): the loader cannot keep the {run.device.type.upper()} busy. "
        f"Raise loader.num_workers (now {workers}){decode}, or put the data on faster storage"
    )


def train_epoch(run: Run, progress: Progress) -> str | None:
    """Train to the end of the epoch; returns a reason when training must stop early."""
    cfg, st, plan = run.cfg, run.state, run.sampler.plan
    run.sampler.set_epoch(st.epoch, st.position)
    meter = Meter(run.device)
    batches = iter(run.loader)  # the batch sampler is read in this process, at iter()
    steps_in_epoch = run.sampler.steps_per_epoch
    while st.position < steps_in_epoch * plan.global_batch and st.step < run.total_steps:
        waited = time.perf_counter()
        micro = [next(batches) for _ in range(plan.accum_steps)]
        slow_data(cfg.fault)
        meter.wait += time.perf_counter() - waited
        if cfg.log.sample_ids:
            write_sample_ids(run, micro)
        if run.skip_bad:
            run.pending_bad += sum(int(b.replaced.sum()) for b in micro)
        loss, norm = train_step(run, micro)
        meter.loss += loss
        meter.grad_norm += norm
        st.step += 1
        st.position += plan.global_batch
        meter.steps += 1
        meter.samples += plan.global_batch
        record = meter.record(run) if st.step % cfg.log.every_steps == 0 else None
        if record:
            run.tracker.write(record)
        progress.update(st.step, record)
        reason = stop_reason(run)
        end_of_epoch = st.position >= steps_in_epoch * plan.global_batch
        if reason or (
            cfg.ckpt.every_steps and st.step % cfg.ckpt.every_steps == 0 and not end_of_epoch
        ):
            save_checkpoint(run)
        if reason:
            return reason
    return None


def stop_reason(run: Run) -> str | None:
    inject_after_step(run.cfg.fault, run.state.step, run.denv.rank)
    stop_at = run.cfg.train.stop_at_step
    if stop_at and run.state.step == stop_at and run.state.step < run.total_steps:
        return "stop_at_step"
    # Ranks agree on a preemption with a collective, at the steps where metrics are reduced
    # anyway: one more per step would cost a device sync on every step.
    if run.state.step % run.cfg.log.every_steps == 0 and D.any_rank(
        preempt.stop_requested(), run.device
    ):
        return "preempted"
    return None


def write_sample_ids(run: Run, micro: list) -> None:
    ids = torch.cat([b.index for b in micro]).tolist()
    gathered = D.gather_objects(ids)
    if run.denv.is_main:
        with (run.run_dir / "samples.jsonl").open("a") as f:
            f.write(json.dumps({"step": run.state.step, "ids": sorted(sum(gathered, []))}) + "\n")


def write_ids(run: Run, record: dict) -> None:
    """log.sample_ids: which samples each rank evaluated, to eval_samples.jsonl (tests)."""
    record["ids_by_rank"] = D.gather_objects(record["ids_by_rank"])
    if run.denv.is_main:
        with (run.run_dir / "eval_samples.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def fit(run: Run) -> str | None:
    cfg, st = run.cfg, run.state
    progress = Progress(run.total_steps, st.step, cfg.log.progress, run.denv.is_main)
    try:
        while st.step < run.total_steps:
            reason = train_epoch(run, progress)
            if reason:
                return reason
            if st.position >= run.sampler.steps_per_epoch * run.sampler.plan.global_batch:
                end_epoch(run, progress)
        if not st.last_eval or st.last_eval.get("step") != st.step:
            st.last_eval = run_eval(run, progress)
            save_checkpoint(run)
        return None
    finally:
        progress.close()


def end_epoch(run: Run, progress: Progress) -> None:
    st = run.state
    st.epoch += 1
    st.position = 0
    if st.epoch % run.cfg.eval.every_epochs == 0 or st.step >= run.total_steps:
        st.last_eval = run_eval(run, progress)
    save_checkpoint(run)


def run_eval(run: Run, progress: Progress) -> dict:
    result = evaluate(run, run.eval_model)
    if run.ema is not None:
        averaged = evaluate(run, run.ema.module)
        result |= {f"ema_{k}": averaged[k] for k in metric_names(averaged)}
    record = {"kind": "eval", "step": run.state.step, "epoch": run.state.epoch} | result
    run.tracker.write(record)
    text = f"eval epoch {record['epoch']} step {record['step']}: {run.task.describe(result)}"
    if run.ema is not None:
        headline = run.task.headline
        text += f", EMA {headline} {result['ema_' + headline]:.4f}"
    progress.message(text)
    return record


def metric_names(result: dict) -> list[str]:
    """The metrics of an evaluation result (not its sample counts)."""
    return [k for k in result if k not in ("count", "skipped")]


# ---------------------------------------------------------------- entry points


def train(cfg: C.Config, recipe: Recipe) -> int:
    started = time.perf_counter()
    denv = D.read_env()
    D.limit_threads(denv)
    set_deterministic(cfg.deterministic)
    device = D.pick_device(cfg.device, denv)
    D.init(denv, cfg.dist, device)
    run = None
    try:
        name = D.broadcast_object(cfg.run.name or rundir.new_run_name(cfg.recipe, cfg.variant))
        cfg.run.name = name
        run = setup(cfg, recipe, denv, device)
        reason = fit_or_explain(run)
        flush_bad_count(run)
        if denv.is_main:
            finish(run, reason, time.perf_counter() - started)
        run.tracker.close()
        return preempt.EXIT_PREEMPTED if reason == "preempted" else 0
    finally:
        if run is not None and run.lock_fd is not None:
            os.close(run.lock_fd)  # the run directory is free for the next launch
        # DDP holds the process group: release it first, so that destroying the group ends
        # gloo's threads now rather than during interpreter shutdown (a SIGABRT at exit).
        run = None
        gc.collect()
        D.shutdown()


PEER_FAILURES = ("Timed out", "timed out", "Connection closed by peer", "Connection reset")


def fit_or_explain(run: Run) -> str | None:
    """fit(), with a peer that hung or died turned from a transport error into a line that
    says what this rank was doing and what to look for."""
    try:
        return fit(run)
    except OSError as err:  # the run directory's disk is full, read-only or gone
        newest = ckpt.list_checkpoints(run.run_dir / "checkpoints")
        intact = f"{newest[0].name} is intact" if newest else "no checkpoint was saved"
        raise RunError(
            f"could not write {err.filename or 'in the run directory'}: {err.strerror or err}; "
            f"{intact}. Free space or fix permissions, then rerun with "
            f"run.name={run.cfg.run.name} to resume"
        ) from None
    except RuntimeError as err:
        text = str(err)
        if not run.denv.distributed or not any(p in text for p in PEER_FAILURES):
            raise
        what = (
            f"no answer from the other ranks within dist.timeout_s={run.cfg.dist.timeout_s:g}s"
            if "imed out" in text
            else "another rank closed its connection"
        )
        raise PeerFailure(
            f"rank {run.denv.rank}: {what} after step {run.state.step} (in a collective: "
            "gradients, metrics, checkpoint or evaluation); a rank hung or died, see the "
            f"first failing rank's log. Rerun with run.name={run.cfg.run.name} to resume"
        ) from None


class PeerFailure(RunError):
    """Reported by every rank that saw it (each says its own view)."""


def finish(run: Run, reason: str | None, seconds: float) -> None:
    st = run.state
    if reason:
        cause = ", ".join(preempt.received()) or "a signal to another rank"
        why = f"{reason}: {cause}" if reason == "preempted" else reason
        log(
            f"stopped at step {st.step} ({why}); checkpoint saved. Resume: rerun with "
            f"run.name={run.cfg.run.name}"
        )
        return
    ev = st.last_eval
    # The eval record's "loss" is "eval_loss" here (beside the training loss in W&B).
    metrics = {("eval_loss" if k == "loss" else k): ev[k] for k in metric_names(ev)}
    metrics = {k: v for k, v in metrics.items() if k not in ("kind", "step", "epoch")}
    summary = metrics | {
        "headline": summary_key(run.task.headline),
        "seconds": seconds,
        "steps": st.step,
        "epochs": st.epoch,
        "world_size": run.denv.world_size,
    }
    if run.skip_bad:
        summary["bad_samples"] = st.bad_samples
        log(f"skipped {st.bad_samples} unreadable training samples (data.skip_bad)")
    ckpt.atomic_write_text(run.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    log(
        f"{run.cfg.recipe}: {run.task.describe(ev)} in {seconds:.1f}s, {st.step} steps; "
        f"run dir {run.run_dir}"
    )


def summary_key(metric: str) -> str:
    """An eval metric's name in summary.json."""
    return "eval_loss" if metric == "loss" else metric


USAGE = "usage: python -m engine.train RECIPE [--config VARIANT] [key=value ...] [--spawn N]"


def _take_option(args: list[str], flag: str) -> str | None:
    """Remove `flag VALUE` from args and return VALUE (None when the flag is absent)."""
    if flag not in args:
        return None
    i = args.index(flag)
    if i + 1 >= len(args) or args[i + 1].startswith("-"):
        raise C.ConfigError(f"{flag} needs a value; {USAGE}")
    value = args[i + 1]
    del args[i : i + 2]
    return value


def parse_argv(argv: list[str]) -> tuple[str, str, list[str], int]:
    """(recipe, variant, overrides, spawn count)."""
    args = list(argv)
    spawn_text = _take_option(args, "--spawn")
    variant = _take_option(args, "--config") or ""
    try:
        spawn = int(spawn_text or 0)
    except ValueError:
        raise C.ConfigError(f"--spawn needs a process count; {USAGE}") from None
    if not args or args[0].startswith("-") or "=" in args[0]:
        raise C.ConfigError(f"no recipe given (available: {', '.join(R.available())}); {USAGE}")
    return args[0], variant, args[1:], spawn


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.umask(os.umask(0) | 0o022)  # nothing the run writes is writable by others
    try:
        recipe_name, variant, overrides, spawn = parse_argv(argv)
        cfg, recipe = R.load_config(recipe_name, overrides, variant)
        denv = D.read_env()  # a half-set environment is a user error too
        preflight(cfg, spawn if spawn > 1 else denv.world_size)
        if spawn > 1:
            from engine.spawn import spawn_local

            head = [recipe_name, *(["--config", variant] if variant else [])]
            return spawn_local(
                spawn, head, overrides, cfg.run.name or rundir.new_run_name(recipe_name, variant)
            )
        preempt.install_handlers()
        return train(cfg, recipe)
    except C.ConfigError as err:
        if is_rank_zero():
            print(f"error: {redact(one_line(err))}", file=sys.stderr)  # all ranks fail alike
        return 2
    except RunError as err:
        if is_rank_zero() or isinstance(err, PeerFailure):
            print(f"error: {redact(str(err))}", file=sys.stderr, flush=True)
        return 1


def is_rank_zero() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def one_line(err: Exception) -> str:
    """The message itself: an error raised in a DataLoader worker arrives wrapped in the
    worker's traceback text, whose last line is `module.Type: message`."""
    last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    prefix = f"{type(err).__module__}.{type(err).__name__}: "
    return last.removeprefix(prefix).removeprefix(f"{type(err).__name__}: ")


def preflight(cfg: C.Config, world_size: int) -> None:
    """Checks that need the world size, done once before any process starts or writes."""
    plan_batches(cfg.train.batch_size, cfg.train.micro_batch_size, world_size)
    if cfg.device == "cpu":
        amp_dtype(cfg.train.amp, torch.device("cpu"))
    if cfg.run.name:
        run_dir = Path(cfg.run.root) / cfg.recipe / cfg.run.name
        rundir.check_fresh_start(run_dir, cfg.resume, cfg.run.overwrite)
    wandb_mode(cfg.log)


if __name__ == "__main__":
    sys.exit(main())
