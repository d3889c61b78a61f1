"""Assembling a run from its config and recipe, in named steps: precision and strategy
resolved once, the data, the model (built, initialised or resumed, placed, wrapped), the
optimizer and schedule, then the run directory claimed and its records started."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine import catalog, codeid, rundir
from engine import checkpoint as ckpt
from engine import config as C
from engine import distributed as D
from engine import parallel as P
from engine import recipe as contract
from engine import weights as home
from engine.checkpoint.state import background_writer, check_resumable, restore, resume_source
from engine.data import fingerprint, shm
from engine.data.device import DeviceData
from engine.data.loaders import SeededSamples, train_loader
from engine.data.mix import build_mix
from engine.data.prefetch import finish_ahead
from engine.data.sampler import BatchPlan, GlobalBatchSampler, plan_batches
from engine.ema import build_ema
from engine.meter import speed_inputs
from engine.optim import build_optimizer, build_scheduler, freeze_parameters
from engine.parallel import Strategy, meta_init
from engine.parts.feed import Feed
from engine.parts.health import Health
from engine.parts.network import Network
from engine.parts.optimisation import Optimisation
from engine.parts.progress import Progress
from engine.parts.records import Records
from engine.recipe import Recipe
from engine.results import task_facts
from engine.run import Run
from engine.seeding import seed_process
from engine.speed import memory_format, set_backend_flags
from engine.tasks import task_of
from engine.tracking import Tracker, environment, log, redact, wandb_mode
from engine.weights import sources


@dataclass
class Decisions:
    """What set-up decides once, before anything is built: where the process runs, how the
    model is wrapped, how the global batch is split, at which precision."""

    cfg: C.Config
    recipe: Recipe
    denv: D.DistEnv
    device: torch.device
    strategy: Strategy
    plan: BatchPlan | None  # None: evaluation alone, which splits no training batch
    dtype: torch.dtype | None  # autocast's; None: off


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    if mode == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if mode == "fp16" and device.type != "cuda":
        raise C.ConfigError("train.amp=fp16 needs a CUDA device; use train.amp=bf16 or off on CPU")
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def check_request(
    cfg: C.Config, recipe: Recipe, strategy: Strategy, device: torch.device, dtype, world_size: int
) -> None:
    """What the recipe and strategy cannot do, refused before anything is built or written."""
    P.check_layout(cfg, world_size)
    P.check_tensor_parallel(cfg, recipe)
    if strategy.fsdp:
        P.check_fsdp(cfg.dist, device, dtype, cfg.ema.decay > 0)
    if cfg.eval.hflip_tta and recipe.mirror is None:
        raise C.ConfigError(
            f"eval.hflip_tta: recipe '{cfg.recipe}' declares no mirror view of its inputs "
            "(Recipe.mirror); unset it"
        )


def build_datasets(cfg: C.Config, recipe: Recipe):
    """Rank 0 first (it scans and caches file indexes; the others then read them), and the
    model's class count from the data when model.num_classes is 0."""
    train_data, eval_data = D.main_first(lambda: recipe.build_datasets(catalog.data_here(cfg)))
    if contract.num_classes(cfg.model) == 0:
        classes = contract.classes(train_data)
        if not classes:
            raise C.ConfigError(
                "model.num_classes=0 follows the data, but this training set lists no "
                "classes; set model.num_classes"
            )
        C.finalize(cfg, {"model.num_classes": len(classes)})
    return train_data, eval_data


def setup(
    cfg: C.Config, recipe: Recipe, denv: D.DistEnv, device: torch.device, records: bool = True
) -> Run:
    """The run, ready to train; records=False (evaluation only) claims no run directory and
    writes nothing."""
    run_dir = rundir.decide_run_dir(cfg.run.root, cfg.recipe, cfg.run.name)
    mode = wandb_mode(cfg.log) if denv.is_main else "off"
    denv = dataclasses.replace(denv, tp=cfg.dist.tp)
    dtype = amp_dtype(cfg.train.amp, device)
    strategy = P.resolve_strategy(cfg.dist.strategy, denv)
    check_request(cfg, recipe, strategy, device, dtype, denv.world_size)
    # the global batch is split over the data-parallel ranks (a TP group reads one part)
    plan = plan_batches(cfg.train.batch_size, cfg.train.micro_batch_size, denv.dp_size)
    decided = Decisions(cfg, recipe, denv, device, strategy, plan, dtype)
    seed_process(cfg.seed, denv.rank)
    data = build_datasets(cfg, recipe)
    model = meta_init.build(recipe, cfg.model)
    code = D.broadcast_object(D.on_main(codeid.identity))  # git once, not on every rank
    prints = D.broadcast_object(
        D.on_main(lambda: fingerprint.of_run(*data, cfg.run.data_fingerprint))
    )
    source = resume_source(cfg, run_dir)
    if source:
        check_resumable(cfg, recipe, strategy, source, denv.is_main, code, prints)
    net = place_model(model, decided, data[0], source)
    run = assemble(decided, run_dir, net, data)
    run.records.code, run.records.data = code, prints
    if source:
        restore(run, source)
        if denv.is_main:
            log(f"resuming from {source[0]} (epoch {run.progress.epoch}, step {run.progress.step})")
    if records:
        open_run_dir(run, mode)
        if denv.is_main:
            record_changes(run, source)
    if denv.local_rank == 0:
        warn_shared_memory(run)
    return run


def setup_eval(cfg: C.Config, recipe: Recipe, denv: D.DistEnv, device: torch.device) -> Run:
    """What evaluation alone needs (engine.eval_only): the data and the model, placed as
    training places it (sharded under FSDP), with no optimizer, training batch, sampler or
    loader, and no run directory claimed or written."""
    denv = dataclasses.replace(denv, tp=cfg.dist.tp)
    dtype = amp_dtype(cfg.train.amp, device)
    strategy = P.resolve_strategy(cfg.dist.strategy, denv)
    check_request(cfg, recipe, strategy, device, dtype, denv.world_size)
    decided = Decisions(cfg, recipe, denv, device, strategy, None, dtype)
    seed_process(cfg.seed, denv.rank)
    train_data, eval_data = build_datasets(cfg, recipe)
    net = place_model(meta_init.build(recipe, cfg.model), decided, train_data, None)
    run = Run(
        cfg=cfg,
        recipe=recipe,
        task=task_of(recipe).for_model(cfg.model),
        denv=denv,
        device=device,
        run_dir=rundir.decide_run_dir(cfg.run.root, cfg.recipe, cfg.run.name),
        net=net,
        opt=Optimisation(None, None, None, dtype),  # precision only: nothing steps
        feed=Feed(None, None, train_data, eval_data),
        progress=Progress(0, cfg.seed, denv.rank, denv.world_size),
        health=Health(skip_bad=contract.skip_bad(cfg.data)),
        records=Records(config=cfg),
    )
    if denv.local_rank == 0:
        warn_shared_memory(run)
    return run


def warn_shared_memory(run: Run) -> None:
    """Said once per node, before any worker starts: the loaders' batches may not fit in
    /dev/shm (training's and evaluation's workers do not hold batches at the same time)."""
    processes = shm.processes_on_node()
    plans = [(run.feed.eval_data, run.cfg.eval.batch_size)]
    if run.feed.sampler is not None:  # training (evaluation alone has no training loader)
        plans.insert(0, (run.feed.train_data, run.feed.sampler.plan.micro_batch))
    for data, batch in plans:
        if isinstance(data, DeviceData):
            continue
        text = shm.check(SeededSamples(data), batch, run.cfg.loader, processes)
        if text:
            log(text)
            return


def place_model(model: nn.Module, decided: Decisions, train_data, source) -> Network:
    """The model with its weights (prepared, initialised by name, or resumed from a single
    file) on the device, wrapped for training. Under FSDP a model on the meta device is
    sharded first and given storage after, so each process only ever holds its own shard; a
    sharded checkpoint is loaded later, with the optimizer (check_format refused a file)."""
    cfg, recipe, strategy, device = decided.cfg, decided.recipe, decided.strategy, decided.device
    from_file = source is not None and not source[0].is_dir()
    if meta_init.on_meta(model) and not strategy.shards:
        # unsharded: the whole model on every process anyway (DDP broadcasts it at wrap time)
        meta_init.initialise(model, recipe, cfg.model, cfg.seed, torch.device("cpu"))
    on_meta = meta_init.on_meta(model)
    if recipe.prepare and not source and not on_meta:  # a resumed run loads prepared weights
        recipe.prepare(model, train_data)
    if from_file and not on_meta:
        ckpt.load_model_state(model, source[1]["model"], source[0])
    from_weights = not source and sources.wanted(cfg.model)
    init = start_from(model, decided) if from_weights and not on_meta else None
    freeze_parameters(model, cfg.optim.freeze)  # before wrapping: DDP and FSDP see it
    set_backend_flags(cfg.train, cfg.deterministic)
    # FSDP2 shards only contiguous parameters: channels_last weights stay unsharded-only.
    layout = memory_format(model, cfg.train.channels_last and not strategy.shards)
    if not on_meta:
        model = model.to(device, memory_format=layout)
    ema = None if on_meta else build_ema(model, cfg.ema)
    if strategy.shards and decided.denv.is_main:
        log(P.describe_mesh(cfg.dist, decided.denv.world_size))
    wrapped, eval_model = P.wrap(
        model,
        P.recipe_blocks(recipe, model, cfg),
        cfg,
        strategy,
        decided.denv,
        device,
        decided.plan.accum_steps if decided.plan else 1,
        decided.dtype,
        recipe.parallelize,
    )
    if on_meta:
        storage = torch.device("cpu") if cfg.dist.cpu_offload else device
        meta_init.initialise(model, recipe, cfg.model, cfg.seed, storage)
        init = start_from(model, decided) if from_weights else None
        ema = build_ema(model, cfg.ema)
    trainable = [p for p in model.parameters() if p.requires_grad]
    plain = not strategy.shards and len({(p.device, p.dtype) for p in trainable}) == 1
    return Network(wrapped, model, eval_model, strategy, layout, trainable, plain, ema, init)


def start_from(model: nn.Module, decided: Decisions) -> dict:
    """model.init_from / model.weights loaded into the model, said once."""
    cfg, denv = decided.cfg, decided.denv
    record = home.start_from(model, cfg.model, denv.is_main)
    if cfg.model.weights:  # followed at load_config already: here for the words recorded
        record["preprocessing"] = home.follow_preprocessing(cfg, decided.recipe)
    if denv.is_main:
        log(home.describe(record))
        warning = sources.name_hash_warning(Path(record["file"]), record["sha256"])
        if cfg.model.weights and warning:
            log(warning)
    return record


def assemble(decided: Decisions, run_dir: Path, net: Network, data: tuple) -> Run:
    """The run at step 0: its parts built for the placed model."""
    cfg, denv, device = decided.cfg, decided.denv, decided.device
    train_data, eval_data = data
    sampler = GlobalBatchSampler(len(train_data), decided.plan, denv.dp_rank, cfg.seed)
    total = cfg.train.max_steps or cfg.train.epochs * sampler.steps_per_epoch
    run = Run(
        cfg=cfg,
        recipe=decided.recipe,
        task=task_of(decided.recipe).for_model(cfg.model),
        denv=denv,
        device=device,
        run_dir=run_dir,
        net=net,
        opt=build_optimisation(decided, net.bare, total, sampler.steps_per_epoch),
        feed=build_feed(decided, net.layout, sampler, train_data, eval_data),
        progress=Progress(total, cfg.seed, denv.rank, denv.world_size),
        health=Health(
            skip_bad=contract.skip_bad(cfg.data),
            first_bad_step=torch.zeros((), dtype=torch.long, device=device),
        ),
        records=Records(
            speed=speed_inputs(decided.recipe, cfg, device, denv.world_size),
            config=cfg,
        ),
    )
    run.held.writer = background_writer(cfg, decided.strategy)
    return run


def build_optimisation(decided: Decisions, model: nn.Module, total: int, epoch_steps: int):
    cfg, device = decided.cfg, decided.device
    optimizer = build_optimizer(
        model, cfg.optim, cfg.train.batch_size, device, decided.strategy.shards
    )
    return Optimisation(
        optimizer,
        build_scheduler(optimizer, total, cfg.sched, epoch_steps),
        torch.amp.GradScaler(device.type, enabled=decided.dtype == torch.float16),
        decided.dtype,
    )


def build_feed(decided: Decisions, layout, sampler, train_data, eval_data) -> Feed:
    cfg, device = decided.cfg, decided.device
    skip_bad = contract.skip_bad(cfg.data)
    loader = train_loader(train_data, sampler, cfg.loader, device, skip_bad)
    ahead = cfg.loader.decode_ahead * decided.plan.accum_steps
    return Feed(
        sampler,
        finish_ahead(loader, train_data, device, ahead, layout),
        train_data,
        eval_data,
        build_mix(cfg.mix, contract.num_classes(cfg.model), cfg.seed),
    )


def open_run_dir(run: Run, wandb: str) -> None:
    """Rank 0 claims the run directory and writes config.yaml, env.json and the tracker's
    first records (W&B in mode `wandb`); every rank contributes its host name."""
    cfg, denv = run.cfg, run.denv
    run.held.lock_fd = D.on_main(lambda: claim_run_dir(cfg, run.run_dir))
    if denv.is_main:
        ckpt.atomic_write_text(run.run_dir / "config.yaml", redact(C.dump(cfg)))
        # W&B's config names the code and the data too
        config = cfg.to_dict() | {"code": run.records.code, "data": data_brief(run)}
        run.records.tracker = Tracker(run.run_dir, cfg.log, wandb, config, run.progress.step)
    hosts = D.gather_objects(D.host_name())
    if denv.is_main:
        task = run.task
        env = environment(denv.world_size, hosts, run.device, run.records.code)
        env["task"] = task_facts(task.headline, task.higher_is_better, task.unit)
        if (
            contract.data_root(cfg.data) is not None
        ):  # where this machine read the data (config: as asked)
            env["data_root"] = catalog.data_here(cfg).root
        if run.net.init_record:
            env["init"] = run.net.init_record
        env["data"] = data_brief(run)
        ckpt.atomic_write_text(run.run_dir / "env.json", json.dumps(env, indent=2) + "\n")


def record_requeue(run: Run, source: tuple[Path, dict] | None) -> None:
    """Rank 0 of a SLURM job started again (SLURM_RESTART_COUNT > 0: preempted and requeued,
    its node lost, `scontrol requeue` by hand): a record in metrics.jsonl and W&B, with how
    the start before it ended (its state.json, not yet overwritten), and a log line."""
    restarts = rundir.slurm_restarts()
    if not restarts:
        return
    try:
        before = json.loads((run.run_dir / rundir.STATE_NAME).read_text())
    except (OSError, ValueError):
        before = {}
    if before.get("state") == "running":  # no word from it: a lost node, a kill, by hand
        cause = "the previous start ended without a word (a node lost, a kill, a requeue by hand)"
    else:
        cause = before.get("why") or before.get("state") or "no record of the previous start"
    step = source[1]["step"] if source else 0
    record = {"kind": "requeue", "step": step, "restart": restarts}
    record |= {"job": rundir.slurm_job(), "cause": cause}
    record |= {"checkpoint": source[0].name} if source else {}
    run.records.tracker.write(record)
    resumed = f"resumed from {source[0].name} (step {step})" if source else "from the start"
    log(f"SLURM start {restarts + 1} of job {record['job']}: {resumed}; before: {cause}")


def record_changes(run: Run, source: tuple[Path, dict] | None) -> None:
    """Rank 0: a SLURM requeue that started it again, and, resuming, what changed since the
    checkpoint (world size, code, data)."""
    record_requeue(run, source)
    if source:
        record_world_change(run, source)
        record_code_change(run, source)
        record_data_change(run, source)


def record_world_change(run: Run, source: tuple[Path, dict]) -> None:
    """Rank 0, resuming on another world size than its checkpoint's (an elastic run that lost
    or gained a node, a job requeued onto fewer nodes): a record of the change, in
    metrics.jsonl and W&B. The steps recorded after the checkpoint are trained again, on the
    same samples; the time lost runs from the checkpoint's writing to this restart."""
    path, saved = source
    old, new = saved.get("world_size"), run.denv.world_size
    if old == new:
        return
    step, plan = saved["step"], run.feed.sampler.plan
    record = {
        "kind": "world_size",
        "step": step,
        "from": old,
        "to": new,
        "checkpoint": path.name,
        "redone_steps": run.records.tracker.last_step - step,
        "accum_steps": plan.accum_steps,
        "micro_batch": plan.micro_batch,
    }
    if "time" in saved:  # absent from checkpoints written before the field
        record["lost_s"] = round(max(time.time() - saved["time"], 0.0), 1)
    run.records.tracker.write(record)
    log(
        f"world size {old} -> {new}: resumed from {path.name} (step {step}), "
        f"{record['redone_steps']} step(s) trained again, {plan.accum_steps} accumulation "
        f"step(s) of {plan.micro_batch} per process"
    )


def record_code_change(run: Run, source: tuple[Path, dict]) -> None:
    """Rank 0, resuming with run.allow_code_change over a checkpoint of other code: a record
    of the change, in metrics.jsonl and W&B, as a change of world size is recorded."""
    path, saved = source
    old = saved.get("code")
    if old is None or codeid.same_code(old, run.records.code):
        return
    change = codeid.difference(old, run.records.code)
    record = {"kind": "code", "step": saved["step"], "from": old, "to": run.records.code}
    run.records.tracker.write(record | {"checkpoint": path.name, "change": change})
    log(
        f"run.allow_code_change: resumed {path.name} (step {saved['step']}) with other code, {change}"
    )


def data_brief(run: Run) -> dict:
    """The data's fingerprints as env.json, summary.json and W&B record them."""
    return fingerprint.brief(run.records.data)


def record_data_change(run: Run, source: tuple[Path, dict]) -> None:
    """Rank 0, resuming with run.allow_data_change over a checkpoint of other data: a record
    of the change, in metrics.jsonl and W&B, as a change of code is recorded."""
    path, saved = source
    old = saved.get("data")
    change = fingerprint.difference(old, run.records.data) if old else None
    if change is None:
        return
    record = {
        "kind": "data",
        "step": saved["step"],
        "from": fingerprint.brief(old),
        "to": data_brief(run),
    }
    run.records.tracker.write(record | {"checkpoint": path.name, "change": change})
    log(
        f"run.allow_data_change: resumed {path.name} (step {saved['step']}) over other data, {change}"
    )


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
