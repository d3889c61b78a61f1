"""How one model is spread over the processes: one process (none), DataParallel (dp), DDP,
FSDP2 (fsdp), or tensor parallelism (dist.tp, with FSDP2 across it), with activation
checkpointing and compilation applied in the right order.

FSDP, DTensor and activation checkpointing are imported only by runs that use them: their
imports cost seconds of start-up."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from engine import distributed as D
from engine.config import Config, ConfigError, DistConfig
from engine.speed import compile_enabled
from engine.tracking import log


@dataclass(frozen=True)
class Strategy:
    """How the model is spread over the processes, resolved once per run (resolve_strategy);
    everything that depends on it reads this value."""

    # what runs: "none", "dp", "ddp", "fsdp" (FSDP2 over the data-parallel ranks, with
    # tensor parallelism inside them when tp > 1) or "tp" (tensor parallelism alone: one
    # data-parallel rank)
    name: str
    # dist.strategy=fsdp was asked for: its checks and its sharded checkpoints apply even in
    # one process, where there is nothing to shard (so the run can go back to several).
    fsdp: bool = False
    tp: int = 1  # processes per tensor-parallel group

    @property
    def shards(self) -> bool:
        """Parameters, gradients and optimizer states are DTensors (FSDP2's or TP's shards)."""
        return self.name in ("fsdp", "tp")


def resolve_strategy(requested: str, denv: D.DistEnv) -> Strategy:
    """The strategy that runs. fsdp in one process trains unsharded, ddp without a wrapper:
    there is nothing to shard or all-reduce, and the run can go back to several processes."""
    if requested == "dp" and denv.distributed:
        raise ConfigError("dist.strategy=dp runs in one process; use ddp with several processes")
    if requested == "none" and denv.distributed:
        raise ConfigError("dist.strategy=none with several processes; use ddp")
    if requested == "auto" and denv.tp == 1:
        return Strategy("ddp" if denv.distributed else "none")
    if requested in ("fsdp", "auto"):  # auto under dist.tp: what tensor parallelism needs
        if denv.tp > 1:
            return Strategy("fsdp" if denv.dp_size > 1 else "tp", fsdp=True, tp=denv.tp)
        return Strategy("fsdp" if denv.distributed else "none", fsdp=True)
    if requested == "ddp" and not denv.distributed:
        return Strategy("none")
    return Strategy(requested)


def shards(dcfg: DistConfig) -> bool:
    """The run shards its weights (FSDP2): asked for, or dist.strategy=auto under dist.tp,
    which tensor parallelism needs."""
    return dcfg.strategy == "fsdp" or (dcfg.strategy == "auto" and dcfg.tp > 1)


def mesh_shape(dcfg: DistConfig, world_size: int) -> tuple[int, ...]:
    """FSDP's device mesh: (world_size,) shards over every process; with dist.replicate=R,
    (R, world_size / R): replicate x shard, each shard group R's consecutive ranks (a node's
    processes under torchrun and srun), so the weights' all-gathers stay within a node and
    only the gradients' all-reduce crosses nodes."""
    replicate = dcfg.replicate
    return (world_size,) if replicate == 1 else (replicate, world_size // replicate)


def check_layout(cfg: Config, world_size: int) -> None:
    """What dist.replicate, dist.tp and ckpt.async_save need of a run on world_size
    processes, said before any process starts (engine.cli.preflight) and again at set-up."""
    replicate, fsdp = cfg.dist.replicate, shards(cfg.dist)
    check_tp_layout(cfg, world_size)
    if replicate > 1 and not fsdp:
        raise ConfigError(
            f"dist.replicate={replicate} is hybrid sharding, which needs dist.strategy=fsdp "
            f"(it is {cfg.dist.strategy}); set dist.strategy=fsdp or unset dist.replicate"
        )
    if world_size % replicate:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"dist.replicate={replicate} does not divide the {world_size} processes of this "
            f"run; use a divisor of {world_size} ({', '.join(map(str, fits))}), e.g. the "
            "number of nodes, or unset it"
        )
    if cfg.ckpt.async_save and not fsdp:
        raise ConfigError(
            "ckpt.async_save writes sharded checkpoints in the background, which needs "
            f"dist.strategy=fsdp (it is {cfg.dist.strategy}); set dist.strategy=fsdp or unset "
            "ckpt.async_save"
        )


def check_tp_layout(cfg: Config, world_size: int) -> None:
    """dist.tp's rules that do not depend on the recipe (check_tensor_parallel has those)."""
    tp = cfg.dist.tp
    if tp == 1:
        return
    if not shards(cfg.dist):
        raise ConfigError(
            f"dist.tp={tp} is tensor parallelism, which runs with FSDP2 over the data-parallel "
            f"ranks: set dist.strategy=fsdp or auto (it is {cfg.dist.strategy})"
        )
    if world_size % tp:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"dist.tp={tp} does not divide the {world_size} processes of this run; use a "
            f"divisor of {world_size} ({', '.join(map(str, fits))}), at most a node's GPUs"
        )
    unsupported = {
        "dist.replicate": cfg.dist.replicate > 1,
        "train.compile=on": cfg.train.compile == "on",
        "ckpt.async_save": cfg.ckpt.async_save,
        "dist.cpu_offload": cfg.dist.cpu_offload,
    }
    for name, asked in unsupported.items():
        if asked:
            raise ConfigError(
                f"{name} with dist.tp={tp}: not supported with tensor parallelism yet "
                "(docs/sharding.md); unset one of them"
            )


def check_tensor_parallel(cfg: Config, recipe) -> None:
    """What the recipe's plan needs (e.g. heads divisible by tp), in one line, or that the
    recipe has a plan at all."""
    if cfg.dist.tp == 1:
        return
    if recipe.parallelize is None or recipe.init_weights is None:
        raise ConfigError(
            f"dist.tp={cfg.dist.tp}: recipe '{cfg.recipe}' declares no tensor-parallel plan "
            "(Recipe.parallelize, with init_weights; the gpt recipe has both); unset dist.tp"
        )
    if recipe.check_tp is not None:
        recipe.check_tp(cfg.model, cfg.data, cfg.dist.tp)


def describe_mesh(dcfg: DistConfig, world_size: int) -> str:
    """The mesh FSDP (and tensor parallelism) run on, for the run's log."""
    if dcfg.tp > 1:
        dp = world_size // dcfg.tp
        return (
            f"tensor parallel on a 2-D mesh (data={dp}, tp={dcfg.tp}): each layer split over "
            f"groups of {dcfg.tp} consecutive ranks"
            + (f", FSDP2 over the {dp} groups" if dp > 1 else ", one data-parallel rank")
        )
    shape = mesh_shape(dcfg, world_size)
    if len(shape) == 1:
        return f"FSDP2 on a 1-D mesh: sharded over {world_size} processes"
    return (
        f"FSDP2 on a 2-D mesh (replicate={shape[0]}, shard={shape[1]}): sharded within groups "
        f"of {shape[1]} consecutive ranks, replicated over {shape[0]} groups (HSDP)"
    )


def recipe_blocks(recipe, model: nn.Module, cfg: Config) -> list[nn.Module]:
    """The recipe's blocks (shard units, checkpointing units), or [] when it declares none."""
    blocks = list(recipe.blocks(model)) if recipe.blocks else []
    if cfg.train.activation_checkpointing and not blocks:
        raise ConfigError(
            f"train.activation_checkpointing: recipe '{cfg.recipe}' declares no blocks to "
            "recompute (Recipe.blocks); unset it"
        )
    return blocks


def wrap(
    model: nn.Module,
    blocks: list[nn.Module],
    cfg: Config,
    strategy: Strategy,
    denv: D.DistEnv,
    device: torch.device,
    accum_steps: int,
    amp: torch.dtype | None,
    plan=None,
) -> tuple[nn.Module, nn.Module]:
    """(the model to train, the model to evaluate). plan: the recipe's tensor-parallel plan
    (Recipe.parallelize), applied when dist.tp > 1. Activation checkpointing first, then
    sharding or replication. Evaluation runs a compiled bare model (no DDP in its graph) for
    static shapes: one graph at the eval batch size (the loop pads the last batch).

    Under DDP the bare model is compiled in place, inside the wrapper: dynamo's DDPOptimizer
    applies to any frame compiled while a DDP forward is active, so the graph is still split
    at DDP's buckets and gradients are all-reduced while the backward pass runs. Compiling DDP
    from outside graph-breaks at DDP's own forward, and resumes in the model's forward, which
    dynamo skips when it is torch's code (an nn.Sequential): such a model ran uncompiled.
    Under FSDP each block is compiled before it is sharded, and the same model evaluates."""
    compiled = compile_enabled(cfg.train.compile, device)
    if cfg.train.activation_checkpointing:
        from engine.parallel.activations import checkpoint_blocks  # start-up time

        checkpoint_blocks(blocks)
    if strategy.tp > 1:
        if compiled and denv.is_main:  # train.compile=on with dist.tp is refused at check
            log("train.compile=auto: off under dist.tp (tensor parallelism does not compile yet)")
        return tensor_parallel(model, blocks, cfg, strategy, denv, device, amp, plan)
    if strategy.shards:
        from engine.parallel import fsdp  # start-up time: FSDP and DTensor imports

        if compiled:
            for block in blocks:
                compile_in_place(block)
        mesh = fsdp.device_mesh(device, mesh_shape(cfg.dist, denv.world_size))
        sharded = fsdp.shard(model, blocks, mesh, cfg.dist, amp)
        return sharded, sharded
    if strategy.name == "ddp":
        if compiled:
            compile_in_place(model, dynamic=False)  # one static graph per shape
        return ddp_wrap(model, cfg.dist, device, accum_steps), model
    eval_model = torch.compile(model, dynamic=False) if compiled else model
    if strategy.name == "dp":  # DataParallel replicates per call, which dynamo cannot trace
        return nn.DataParallel(torch.compile(model) if compiled else model), eval_model
    return (torch.compile(model) if compiled else model), eval_model


def tensor_parallel(
    model: nn.Module,
    blocks: list[nn.Module],
    cfg: Config,
    strategy: Strategy,
    denv: D.DistEnv,
    device: torch.device,
    amp: torch.dtype | None,
    plan,
) -> tuple[nn.Module, nn.Module]:
    """torchtitan's order: the recipe's plan on the tensor-parallel dimension first, then
    activation checkpointing (applied by wrap already: it wraps modules, not parameters),
    then FSDP2 over the data-parallel one. The mesh is (world / tp, tp), row-major: a TP
    group is tp consecutive ranks (a node's processes), the data-parallel groups stride
    across them. Reductions of data (losses, counts) go over the data-parallel group only:
    a TP group's ranks hold the same batch."""
    from engine.parallel import fsdp  # start-up time: FSDP and DTensor imports

    mesh = fsdp.device_mesh(device, (denv.dp_size, strategy.tp), ("shard", "tp"))
    D.use_data_group(mesh["shard"].get_group())
    plan(model, mesh["tp"])
    if strategy.name == "fsdp":
        fsdp.shard(model, blocks, mesh["shard"], cfg.dist, amp)
    return model, model


def compile_in_place(module: nn.Module, **options) -> None:
    """module.compile(**options), with the compiled frame a function of this file rather than
    torch's Module._call_impl. Before torch 2.14 (pytorch/pytorch#150915) dynamo did not trace
    into the forward of a module it skips as torch's own code when that frame was the top one:
    an nn.Sequential compiled so, under DDP, ran eagerly (one call captured for 14 layers).
    From a frame of ours dynamo inlines _call_impl and the forward on every torch."""
    call = module._call_impl

    def call_module(*args, **kwargs):
        return call(*args, **kwargs)

    # the attribute Module.compile sets: nn.Module's __call__ runs it in place of _call_impl
    module._compiled_call_impl = torch.compile(call_module, **options)


def ddp_wrap(model: nn.Module, dcfg: DistConfig, device: torch.device, accum_steps: int):
    if dcfg.sync_bn:
        if device.type != "cuda":
            raise ConfigError("dist.sync_bn needs CUDA devices (no CPU kernel); unset it")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        # A static graph and no_sync() break each other (DDP's expect_autograd_hooks_
        # assert at the first accumulated step), so accumulation runs without it.
        static_graph=dcfg.static_graph and not dcfg.find_unused_parameters and accum_steps == 1,
        find_unused_parameters=dcfg.find_unused_parameters,
    )


def gradient_sync(model: nn.Module, strategy: Strategy, last: bool):
    """A context for one micro batch's backward: gradients are reduced over the processes on
    the last micro batch of a step only (DDP's no_sync, FSDP's requires_gradient_sync)."""
    if strategy.name == "fsdp":
        model.set_requires_gradient_sync(last)  # FSDP2
        return contextlib.nullcontext()
    if last or strategy.name != "ddp":
        return contextlib.nullcontext()
    return model.no_sync()


def check_fsdp(dcfg: DistConfig, device: torch.device, amp: torch.dtype | None, ema: bool) -> None:
    from engine.parallel import fsdp  # start-up time: FSDP and DTensor imports

    fsdp.check(dcfg, device, amp, ema)
