"""The configuration's schema: every section as a dataclass, the top-level keys, and Config.

Every section is a dataclass; a builder receives only its own section. Each field declares its
valid range (`bounded`) and whether a resumed run may change it (`resume_safe`) beside its
default; a section safe to change as a whole says so once (`resume_safe = True`).

`python -m engine.train --help` lists every key with its type, default, range and meaning,
generated from these dataclasses; a field's meaning is the comment at the end of its line, else
the comment lines just above it, so every field carries one (tests/engine/test_cli_help.py)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.config.fields import Range, bounded, guarded, is_resume_safe, safe


@dataclass
class RunConfig:
    resume_safe = True  # a resumed run may change it: where the run lives

    name: str = ""  # empty: a new time-stamped name per launch
    root: str = "runs"  # run directories are <root>/<recipe>/<name>
    # resume=none on a run directory that holds a run: move its contents aside into
    # <name>.replaced-<time> and start afresh (without it, such a launch is refused).
    overwrite: bool = False
    # resume a checkpoint written by other code (another commit or other uncommitted
    # changes): refused unless true; the change is recorded in metrics.jsonl
    allow_code_change: bool = False
    # resume a checkpoint written over other data (a file added, removed or resized, other
    # tensors): refused unless true; the change is recorded in metrics.jsonl
    allow_data_change: bool = False
    # how a folder of files is fingerprinted (env.json, summary.json, checkpoints): index
    # (names, sizes, labels; no file read) or content (every file's bytes, cached by size
    # and mtime); in-memory data is always fingerprinted by its bytes
    data_fingerprint: Literal["index", "content"] = "index"


@dataclass
class TrainConfig:
    # passes over the training set (unless max_steps > 0)
    epochs: int = bounded(1, ge=0, resume_safe=True)
    # > 0: train this many optimizer steps instead of `epochs`
    max_steps: int = bounded(0, ge=0, resume_safe=True)
    # > 0: checkpoint and stop after this step (the schedule is unchanged)
    stop_at_step: int = bounded(0, ge=0, resume_safe=True)
    batch_size: int = bounded(64, ge=1)  # global: summed over processes and accumulation steps
    # per process; sets accumulation steps
    micro_batch_size: int | None = bounded(None, ge=1, resume_safe=True)
    grad_clip: float = bounded(0.0, ge=0)  # max gradient norm; 0: off
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA, off on CPU
    # Speed defaults. tf32 and cudnn_benchmark act only when deterministic=false.
    channels_last: bool = safe(True)  # NHWC layout for models with 2-d convolutions
    # torch.compile; auto: on for CUDA, off on CPU
    compile: Literal["auto", "on", "off"] = safe("auto")
    tf32: bool = safe(True)  # TF32 for matmuls and convolutions on CUDA
    cudnn_benchmark: bool = safe(True)  # cuDNN's autotuner picks the fastest convolution kernels
    # Training loss only; evaluation reports plain cross entropy.
    label_smoothing: float = bounded(0.0, ge=0, lt=1)
    # Non-finite gradients (without fp16, whose scaler skips such steps itself): stop before
    # the next checkpoint, naming the step, or skip the step and count it.
    nan_policy: Literal["stop", "skip"] = safe("stop")
    # Recompute each block's activations in the backward pass instead of keeping them (the
    # recipe's blocks, e.g. transformer layers): less memory, about a third more compute,
    # the same gradients.
    activation_checkpointing: bool = safe(False)


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = "sgd"  # the optimizer
    lr: float = bounded(0.1, gt=0)  # peak learning rate (after warmup)
    momentum: float = bounded(0.9, ge=0, lt=1)  # sgd only
    nesterov: bool = False  # sgd only: Nesterov momentum
    weight_decay: float = bounded(0.0, ge=0)  # decoupled for adamw, L2 for sgd
    betas: list[float] = bounded(default_factory=lambda: [0.9, 0.999], ge=0, lt=1)  # adamw only
    eps: float = bounded(1e-8, gt=0)  # adamw only: added to the denominator
    # > 0: optim.lr is the rate for a global batch of this size and scales linearly with
    # train.batch_size (the linear scaling rule); the global batch, not the GPU count, decides.
    lr_reference_batch: int = bounded(0, ge=0)
    # Weight decay on norm weights and biases too (1-d parameters); off: they are not decayed.
    decay_norm_bias: bool = False
    # Parameters left as they are (no gradient, not in the optimizer), by name pattern
    # (fnmatch, e.g. "layer1.*"); each pattern must match a parameter. Norm layers in a frozen
    # part still update their running statistics in training mode.
    freeze: list[str] = field(default_factory=list)
    # "PATTERN=FACTOR" entries: parameters whose name matches get optim.lr x FACTOR (weight
    # decay unchanged), the first matching entry wins, e.g. ["fc.*=1", "*=0.1"]: the head at
    # the full rate, the rest at a tenth.
    lr_mult: list[str] = field(default_factory=list)
    # How the update runs: fused (one kernel for all parameters), foreach (batched ops),
    # loop (per parameter). auto: fused where the device supports it, else foreach.
    implementation: Literal["auto", "fused", "foreach", "loop"] = safe("auto")


@dataclass
class SchedConfig:
    """Counted in optimizer steps; the *_epochs forms are converted with the steps per epoch."""

    name: Literal["cosine", "linear", "step", "constant"] = "cosine"  # lr shape after warmup
    warmup_steps: int = bounded(0, ge=0)  # linear warmup from warmup_start * optim.lr
    warmup_epochs: float = bounded(0.0, ge=0)  # alternative to warmup_steps
    # The lr factor at the first step of warmup (torchvision: 0.01).
    warmup_start: float = bounded(0.0, ge=0, le=1)
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)  # cosine/linear floor, as a fraction of optim.lr
    milestones: list[int] = bounded(default_factory=list, ge=0)  # step schedule, in optimizer steps
    milestone_epochs: list[float] = bounded(default_factory=list, ge=0)  # alternative to milestones
    gamma: float = bounded(0.1, gt=0, le=1)  # lr factor at each milestone


@dataclass
class LoaderConfig:
    # data loading processes per training process
    num_workers: int = bounded(0, ge=0, resume_safe=True)
    pin_memory: bool = safe(True)  # only takes effect on CUDA
    persistent_workers: bool = safe(True)  # keep the workers alive from one epoch to the next
    prefetch_factor: int = bounded(2, ge=1, resume_safe=True)  # batches each worker loads ahead
    # Steps whose batches data.decode=gpu decodes on the device ahead of the training step,
    # in a thread on a CUDA stream of its own (CUDA, with loader workers); 0: in the step.
    decode_ahead: int = bounded(1, ge=0, le=8, resume_safe=True)
    # Also seed python's `random` and numpy per sample, for augmentations that draw from them
    # (torch's RNG is always seeded per sample).
    seed_python_numpy: bool = False


@dataclass
class EvalConfig:
    resume_safe = True  # a resumed run may change it: how it is evaluated

    every_epochs: int = bounded(1, ge=1)  # evaluate after every this many epochs (and at the end)
    batch_size: int = bounded(256, ge=1)  # per process
    hflip_tta: bool = False  # average the logits of each image and its mirror


@dataclass
class MixConfig:
    """MixUp/CutMix on training batches (torchvision.transforms.v2), one of them per micro
    batch when both are on; partners and lambda are a function of (seed, epoch, position)."""

    mixup_alpha: float = bounded(0.0, ge=0)  # 0: off
    cutmix_alpha: float = bounded(0.0, ge=0)  # 0: off


@dataclass
class EmaConfig:
    """An exponential moving average of the weights (torch.optim.swa_utils.AveragedModel),
    evaluated beside the model and kept in checkpoints."""

    decay: float = bounded(0.0, ge=0, lt=1)  # per update; 0: off
    every_steps: int = bounded(1, ge=1)  # update after every this many optimizer steps
    warmup_steps: int = bounded(0, ge=0)  # before this step the average just copies the weights


@dataclass
class CheckpointConfig:
    resume_safe = True  # a resumed run may change it: how it is checkpointed

    every_steps: int = bounded(0, ge=0)  # 0: only at the end of each epoch
    keep: int = bounded(3, ge=1)  # the newest this many checkpoints are kept
    best: int = bounded(1, ge=0)  # also this many best by the headline metric, in best/; 0: off
    # dist.strategy=fsdp: copy each rank's shards into CPU memory and write them from a
    # background thread while training goes on (DCP's async_save); the checkpoint still counts
    # only once complete. Costs a CPU copy of this rank's model and optimizer shards.
    async_save: bool = False


@dataclass
class LogConfig:
    resume_safe = True  # a resumed run may change it: how it is logged

    every_steps: int = bounded(10, ge=1)  # also how often ranks agree on a preemption signal
    # W&B; auto: online with credentials and a server that answers, else offline
    wandb: Literal["auto", "online", "offline", "off"] = "auto"
    project: str = "recipes"  # the W&B project
    entity: str | None = None  # the W&B user or team; null: the account's default
    progress: Literal["auto", "bar", "plain", "off"] = "auto"  # auto: a bar on a terminal
    sample_ids: bool = False  # write each step's global sample ids to samples.jsonl (tests)
    # Also write each train and eval record's numbers as TensorBoard scalars as they come, to
    # <run dir>/tensorboard/ (tensorboard's event file writer; make publish does it afterwards)
    tensorboard: bool = False
    # Peak dense TFLOP/s of one device, for MFU; 0: from the GPU's name (bf16 datasheet
    # figure of known GPUs), no MFU on CPU.
    peak_tflops: float = bounded(0.0, ge=0)
    # Warn once when more than this fraction of a log window was spent waiting for data.
    data_wait_warn: float = bounded(0.1, gt=0, le=1)


@dataclass
class ProfConfig:
    resume_safe = True  # a resumed run may change it: what is recorded about the run

    # "A:B": a torch.profiler trace of optimizer steps A to B into <run>/profile/ (with a
    # summary that make report shows); "": none
    steps: str = ""
    ranks: str = "0"  # the ranks that trace: "all", or ranks separated by commas
    # CUDA: record the allocator's history; a snapshot at the end of the trace window, of
    # the run, and on an out-of-memory error (<run>/profile/rank<r>-memory.pickle)
    memory: bool = False


@dataclass
class DistConfig:
    resume_safe = (
        True  # a resumed run may change it: how it is spread over processes, except sync_bn
    )

    # auto: ddp with several processes, none with one. fsdp: FSDP2 shards parameters,
    # gradients and optimizer states over the processes (ZeRO-3), per block of the recipe.
    strategy: Literal["auto", "ddp", "dp", "fsdp", "none"] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    init_method: str = "env://"  # or tcp://host:port, file:///shared/path
    timeout_s: float = bounded(600.0, gt=0)  # how long a collective waits for the other ranks
    # > 0: a rank whose training makes no progress (steps, evaluation batches, checkpoints)
    # for this many seconds writes every thread's Python stack to <run dir>/hang/, one line
    # names the ranks behind and the step, and the run exits 1. Below timeout_s, so it comes
    # before the collective's timeout. 0: off.
    hang_s: float = bounded(300.0, ge=0)
    # Guarded: batch statistics over all ranks are another computation, not safe on resume.
    sync_bn: bool = guarded(False)  # batch norm statistics over all processes (SyncBatchNorm)
    find_unused_parameters: bool = False  # ddp: for models that leave parameters unused
    static_graph: bool = True  # ddp: the same graph every step (off with accumulation)
    # fsdp: free the gathered parameters after each block's forward (ZeRO-3) or keep them
    # until its backward (more memory, one all-gather less per step: ZeRO-2-like).
    fsdp_reshard_after_forward: bool = True
    # fsdp with bf16/fp16 amp: reduce gradients in fp32 (exact sums) or in the compute dtype.
    fsdp_reduce_fp32: bool = True
    # fsdp: keep the sharded parameters, gradients and optimizer states in CPU memory.
    cpu_offload: bool = False
    # fsdp: hybrid sharding (HSDP) on a 2-D mesh (replicate x shard): the model is sharded
    # within groups of world size / replicate consecutive ranks (a node) and replicated
    # across the replicate groups; 1: sharded over all processes. Must divide the world size.
    replicate: int = bounded(1, ge=1)
    # tensor parallelism: the recipe's layers split over groups of tp consecutive ranks (a
    # node's processes; Megatron's split through DTensor), FSDP2 over the world / tp groups
    # on a 2-D mesh. Needs dist.strategy=fsdp (auto becomes it) and a recipe with a plan
    # (gpt). 1: off.
    tp: int = bounded(1, ge=1)


@dataclass
class FaultConfig:
    """Deliberate failures, for fault tests and for rehearsing what a crash looks like."""

    resume_safe = True  # a resumed run may change it: deliberate failures
    test_only = True  # left out of --help (listed by --help-all)

    raise_at_step: int = bounded(0, ge=0)  # > 0: raise an error after this optimizer step
    rank: int = bounded(0, ge=0)  # on this global rank only
    # The ones below act only in a process's first attempt (not after a torchrun restart).
    signal_at_step: int = bounded(0, ge=0)  # > 0: send `signal` to this process after this step
    signal: Literal["SIGKILL", "SIGTERM", "SIGINT", "SIGUSR2"] = "SIGKILL"  # for signal_at_step
    # > 0: stop responding (sleep) after this step, as a hung rank does
    hang_at_step: int = bounded(0, ge=0)
    hang_in_save_at_step: int = bounded(0, ge=0)  # > 0: stall mid-write of this step's checkpoint
    # > 0: this step's loss (and so its gradients) is NaN, every attempt
    nan_at_step: int = bounded(0, ge=0)
    data_delay_ms: float = bounded(0.0, ge=0)  # > 0: every batch fetch takes this much longer


@dataclass
class SlurmConfig:
    """Read by launch/ when submitting; validated here like every other section."""

    resume_safe = True  # a resumed run may change it: how it is scheduled

    partition: str | None = None  # sbatch --partition
    account: str | None = None  # sbatch --account
    qos: str | None = None  # sbatch --qos
    time_min: int = bounded(60, ge=1)  # the job's time limit, in minutes
    # What the recipe needs on a cluster, asked for by submit and SLURM sweeps unless GPUS
    # (or NODES) is given; never the GPUs of the submitting host. 0: CPU tasks.
    gpus_per_node: int = bounded(0, ge=0)
    nodes: int = bounded(1, ge=1)  # nodes the recipe needs on a cluster (NODES overrides)
    cpus_per_task: int | None = bounded(None, ge=1)  # per training process
    mem_gb: int | None = bounded(None, ge=1)  # memory per node
    constraint: str | None = None  # sbatch --constraint, e.g. a GPU type's feature
    exclude: str | None = None  # nodes to leave out, sbatch --exclude
    setup: list[str] = field(default_factory=list)  # shell lines run before training starts
    signal_delay_s: int = bounded(120, ge=0)  # SIGUSR2 this many seconds before the time limit
    max_requeues: int = bounded(20, ge=1)  # stop requeueing a job that was requeued this often


ENGINE_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "sched": SchedConfig,
    "loader": LoaderConfig,
    "eval": EvalConfig,
    "mix": MixConfig,
    "ema": EmaConfig,
    "ckpt": CheckpointConfig,
    "log": LogConfig,
    "prof": ProfConfig,
    "dist": DistConfig,
    "slurm": SlurmConfig,
    "fault": FaultConfig,
}

RECIPE_SECTIONS = ("model", "data")  # a recipe's sections: its model_config and data_config


@dataclass
class WeightsInit:
    """Every recipe's model section also has these keys (with_weights_init): where the
    model's first weights come from, when not from the seed. A resumed run loads its
    checkpoint instead."""

    # A file or folder whose weights start the run: a checkpoint (file, sharded folder, or a
    # run folder: its newest valid one), an export (.pt, .safetensors), a torchvision or timm
    # weights file; wrapper prefixes (module., _orig_mod.) are dropped.
    init_from: str = ""
    # A torchvision weights name (e.g. ResNet50_Weights.IMAGENET1K_V2), read from the local
    # cache ($TORCH_HOME/hub/checkpoints) only, never downloaded; its eval preprocessing is
    # used unless data.augment.follow_weights=false.
    weights: str = ""
    init_ema: bool = False  # take the averaged weights (EMA) of a checkpoint that holds them
    # Every tensor must match by name and shape: no head is re-initialised, none left unused.
    init_strict: bool = False
    # Tensors kept as the seed initialised them, by name pattern (fnmatch, e.g. "conv1.*").
    init_skip: list[str] = field(default_factory=list)


@functools.cache  # one class per recipe: resolving twice gives configs of the same type
def with_weights_init(model_config: type) -> type:
    """The recipe's model section with WeightsInit's keys after its own (a subclass: the
    recipe's builder receives what it declared, plus keys it need not read)."""
    if issubclass(model_config, WeightsInit):
        return model_config
    hints = typing.get_type_hints(WeightsInit)
    added = [
        (f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory))
        for f in dataclasses.fields(WeightsInit)
    ]
    made = dataclasses.make_dataclass(model_config.__name__, added, bases=(model_config,))
    made.__module__, made.__qualname__ = model_config.__module__, model_config.__qualname__
    made.meanings_from = WeightsInit  # field_meanings reads the keys' comments there
    return made


@dataclass
class Config:
    """A resolved configuration: the top-level keys and one typed section per name, the
    engine's (ENGINE_SECTIONS) and the recipe's (model, data); Config.from_sections builds one
    from a mapping of section name -> section."""

    recipe: str  # the recipe's folder name under recipes/
    seed: int  # seeds the weights, the data order and every random draw
    deterministic: bool  # deterministic kernels: bitwise repeatable runs, somewhat slower
    device: str  # auto | cpu | cuda
    resume: str  # auto | none | path to a checkpoint file
    # The engine's sections, as ENGINE_SECTIONS orders them.
    run: RunConfig
    train: TrainConfig
    optim: OptimConfig
    sched: SchedConfig
    loader: LoaderConfig
    eval: EvalConfig
    mix: MixConfig
    ema: EmaConfig
    ckpt: CheckpointConfig
    log: LogConfig
    prof: ProfConfig
    dist: DistConfig
    slurm: SlurmConfig
    fault: FaultConfig
    model: Any = None  # the recipe's model section (its model_config, with WeightsInit's keys)
    data: Any = None  # the recipe's data section (its data_config)
    variant: str = ""  # the recipe's named config layered on config.yaml ("" for none)
    # The recipe's section names in its order (to_dict keeps it), and its sections other than
    # model and data, if it has any.
    recipe_order: tuple[str, ...] = field(default=RECIPE_SECTIONS, compare=False, repr=False)
    other_sections: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_sections(
        cls, recipe: str, sections: dict[str, Any], variant: str = "", **top: Any
    ) -> Config:
        """A Config from section name -> section: every engine section, then the recipe's."""
        recipe_order = tuple(name for name in sections if name not in ENGINE_SECTIONS)
        named = {k: sections[k] for k in recipe_order if k in RECIPE_SECTIONS}
        others = {k: sections[k] for k in recipe_order if k not in RECIPE_SECTIONS}
        engine = {name: sections[name] for name in ENGINE_SECTIONS}
        return cls(
            recipe=recipe,
            variant=variant,
            **top,
            **engine,
            **named,
            recipe_order=recipe_order,
            other_sections=others,
        )

    @property
    def sections(self) -> dict[str, Any]:
        """Section name -> section, the engine's as ENGINE_SECTIONS orders them, then the
        recipe's in its order: a new dict each time, so assigning a key in it replaces no
        section of the config."""
        found = {name: getattr(self, name) for name in ENGINE_SECTIONS}
        for name in self.recipe_order:
            found[name] = (
                getattr(self, name) if name in RECIPE_SECTIONS else self.other_sections[name]
            )
        return found

    def to_dict(self) -> dict[str, Any]:
        top = {"recipe": self.recipe, "seed": self.seed, "deterministic": self.deterministic}
        top |= {"device": self.device, "resume": self.resume, "variant": self.variant}
        return top | {k: dataclasses.asdict(v) for k, v in self.sections.items()}


TOP_LEVEL = {"seed": 0, "deterministic": False, "device": "auto", "resume": "auto"}
TOP_TYPES = {"seed": int, "deterministic": bool, "device": Literal["auto", "cpu", "cuda"]}
TOP_TYPES["resume"] = str
TOP_RANGES = {"seed": Range(ge=0, lt=2**64)}  # seeds are mixed as 64-bit words (seeding.py)

# Top-level keys a resumed run may change: where it runs, what it resumes from, whether its
# kernels are deterministic, and its variant's name (the variant's values are compared key by
# key like any other).
TOP_RESUME_SAFE = ("device", "resume", "deterministic", "variant")
# A key of every recipe's own sections that a resumed run may change: where its data is read
# from (recipes/*/data.py declare `root`). A recipe adds its own through Recipe.resume_safe.
RECIPE_RESUME_SAFE = ("data.root",)


def is_test_only(section: type) -> bool:
    """A section for tests (deliberate failures), left out of --help."""
    return bool(getattr(section, "test_only", False))


def resume_safe_keys() -> tuple[str, ...]:
    """The keys a resumed run may change and stay the same run, as dotted prefixes: a key is
    safe when it starts with one of them. A section safe as a whole is its name and a dot,
    another section each of its safe fields; then the recipe's keys and the top-level ones."""
    keys: list[str] = []
    for name, cls in ENGINE_SECTIONS.items():
        fields = dataclasses.fields(cls)
        if getattr(cls, "resume_safe", False) and all(is_resume_safe(cls, f) for f in fields):
            keys.append(f"{name}.")
        else:
            keys += [f"{name}.{f.name}" for f in fields if is_resume_safe(cls, f)]
    return (*keys, *RECIPE_RESUME_SAFE, *TOP_RESUME_SAFE)
