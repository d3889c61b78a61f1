"""Typed configuration: engine defaults < recipe config.yaml < dotted CLI overrides.

Every section is a dataclass; a builder receives only its own section. Validation happens
before anything is written, and every mistake is reported as one line (ConfigError).

Each numeric field declares its valid range beside its default (`bounded`), checked for
engine and recipe sections alike. An override's value is read by its field's type: a text
field (str, str | None, a Literal of strings) takes the text as written, so `run.name=0123`
is "0123"; for `str | None` YAML's spellings of null (empty, ~, null, Null, NULL) mean None,
as in a config file. Other fields read the value as YAML (`optim.lr=0.2`, `train.amp=off`,
`sched.milestones=[1, 2]`), a float field also in exponent form (`optim.lr=1e-3`). In YAML
files values stay YAML: a number where text is expected (`name: 0123`) is an error, never a
silent "83".

`python -m engine.train --help` lists every key with its type, default, range and meaning,
generated from these dataclasses; a field's meaning is the comment at the end of its line, else
the comment lines just above it, so every field carries one (tests/engine/test_cli_help.py)."""

from __future__ import annotations

import ast
import dataclasses
import datetime
import difflib
import functools
import inspect
import io
import math
import re
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A user mistake in the configuration; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class Range:
    """The valid values of a number: each bound inclusive (ge, le) or not (gt, lt), or open."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def admits(self, value: float) -> bool:
        # Every comparison with NaN is false, so NaN is outside any range with a bound.
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def __str__(self) -> str:
        ge, gt, le, lt = (_show(bound) for bound in (self.ge, self.gt, self.le, self.lt))
        if (ge is not None or gt is not None) and (le is not None or lt is not None):
            opening = f"[{ge}" if ge is not None else f"({gt}"
            closing = f"{le}]" if le is not None else f"{lt})"
            return f"in {opening}, {closing}"  # e.g. in [0, 1)
        bounds = [(">=", ge), (">", gt), ("<=", le), ("<", lt)]
        return " and ".join(f"{op} {bound}" for op, bound in bounds if bound is not None)


def _show(bound: float | None) -> str | None:
    """A bound as written in a message: 2**64 rather than its twenty digits."""
    if isinstance(bound, int) and bound >= 2**16 and bound.bit_count() == 1:
        return f"2**{bound.bit_length() - 1}"
    return None if bound is None else str(bound)


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with a valid range; it applies to each item of a list, and None
    (for an optional field) always passes. Example: `batch_size: int = bounded(64, ge=1)`."""
    allowed = Range(ge=ge, gt=gt, le=le, lt=lt)
    return field(default=default, default_factory=default_factory, metadata={"range": allowed})


@dataclass
class RunConfig:
    name: str = ""  # empty: a new time-stamped name per launch
    root: str = "runs"  # run directories are <root>/<recipe>/<name>
    # resume=none on a run directory that holds a run: move its contents aside into
    # <name>.replaced-<time> and start afresh (without it, such a launch is refused).
    overwrite: bool = False


@dataclass
class TrainConfig:
    epochs: int = bounded(1, ge=0)  # passes over the training set (unless max_steps > 0)
    max_steps: int = bounded(0, ge=0)  # > 0: train this many optimizer steps instead of `epochs`
    # > 0: checkpoint and stop after this step (the schedule is unchanged)
    stop_at_step: int = bounded(0, ge=0)
    batch_size: int = bounded(64, ge=1)  # global: summed over processes and accumulation steps
    micro_batch_size: int | None = bounded(None, ge=1)  # per process; sets accumulation steps
    grad_clip: float = bounded(0.0, ge=0)  # max gradient norm; 0: off
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA, off on CPU
    # Speed defaults. tf32 and cudnn_benchmark act only when deterministic=false.
    channels_last: bool = True  # NHWC layout for models with 2-d convolutions
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile; auto: on for CUDA, off on CPU
    tf32: bool = True  # TF32 for matmuls and convolutions on CUDA
    cudnn_benchmark: bool = True  # cuDNN's autotuner picks the fastest convolution kernels
    # Training loss only; evaluation reports plain cross entropy.
    label_smoothing: float = bounded(0.0, ge=0, lt=1)
    # Non-finite gradients (without fp16, whose scaler skips such steps itself): stop before
    # the next checkpoint, naming the step, or skip the step and count it.
    nan_policy: Literal["stop", "skip"] = "stop"
    # Recompute each block's activations in the backward pass instead of keeping them (the
    # recipe's blocks, e.g. transformer layers): less memory, about a third more compute,
    # the same gradients.
    activation_checkpointing: bool = False


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
    implementation: Literal["auto", "fused", "foreach", "loop"] = "auto"


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
    num_workers: int = bounded(0, ge=0)  # data loading processes per training process
    pin_memory: bool = True  # only takes effect on CUDA
    persistent_workers: bool = True  # keep the workers alive from one epoch to the next
    prefetch_factor: int = bounded(2, ge=1)  # batches each worker loads ahead
    # Steps whose batches data.decode=gpu decodes on the device ahead of the training step,
    # in a thread on a CUDA stream of its own (CUDA, with loader workers); 0: in the step.
    decode_ahead: int = bounded(1, ge=0, le=8)
    # Also seed python's `random` and numpy per sample, for augmentations that draw from them
    # (torch's RNG is always seeded per sample).
    seed_python_numpy: bool = False


@dataclass
class EvalConfig:
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
    every_steps: int = bounded(0, ge=0)  # 0: only at the end of each epoch
    keep: int = bounded(3, ge=1)  # the newest this many checkpoints are kept
    best: int = bounded(1, ge=0)  # also this many best by the headline metric, in best/; 0: off


@dataclass
class LogConfig:
    every_steps: int = bounded(10, ge=1)  # also how often ranks agree on a preemption signal
    # W&B; auto: online with credentials and a server that answers, else offline
    wandb: Literal["auto", "online", "offline", "off"] = "auto"
    project: str = "recipes"  # the W&B project
    entity: str | None = None  # the W&B user or team; null: the account's default
    progress: Literal["auto", "bar", "plain", "off"] = "auto"  # auto: a bar on a terminal
    sample_ids: bool = False  # write each step's global sample ids to samples.jsonl (tests)
    # Peak dense TFLOP/s of one device, for MFU; 0: from the GPU's name (bf16 datasheet
    # figure of known GPUs), no MFU on CPU.
    peak_tflops: float = bounded(0.0, ge=0)
    # Warn once when more than this fraction of a log window was spent waiting for data.
    data_wait_warn: float = bounded(0.1, gt=0, le=1)


@dataclass
class DistConfig:
    # auto: ddp with several processes, none with one. fsdp: FSDP2 shards parameters,
    # gradients and optimizer states over the processes (ZeRO-3), per block of the recipe.
    strategy: Literal["auto", "ddp", "dp", "fsdp", "none"] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    init_method: str = "env://"  # or tcp://host:port, file:///shared/path
    timeout_s: float = bounded(600.0, gt=0)  # how long a collective waits for the other ranks
    sync_bn: bool = False  # batch norm statistics over all processes (SyncBatchNorm)
    find_unused_parameters: bool = False  # ddp: for models that leave parameters unused
    static_graph: bool = True  # ddp: the same graph every step (off with accumulation)
    # fsdp: free the gathered parameters after each block's forward (ZeRO-3) or keep them
    # until its backward (more memory, one all-gather less per step: ZeRO-2-like).
    fsdp_reshard_after_forward: bool = True
    # fsdp with bf16/fp16 amp: reduce gradients in fp32 (exact sums) or in the compute dtype.
    fsdp_reduce_fp32: bool = True
    # fsdp: keep the sharded parameters, gradients and optimizer states in CPU memory.
    cpu_offload: bool = False


@dataclass
class FaultConfig:
    """Deliberate failures, for fault tests and for rehearsing what a crash looks like."""

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
    "dist": DistConfig,
    "slurm": SlurmConfig,
    "fault": FaultConfig,
}


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
    recipe: str  # the recipe's folder name under recipes/
    seed: int  # seeds the weights, the data order and every random draw
    deterministic: bool  # deterministic kernels: bitwise repeatable runs, somewhat slower
    device: str  # auto | cpu | cuda
    resume: str  # auto | none | path to a checkpoint file
    sections: dict[str, Any]  # section name -> dataclass instance
    variant: str = ""  # the recipe's named config layered on config.yaml ("" for none)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["sections"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        top = {"recipe": self.recipe, "seed": self.seed, "deterministic": self.deterministic}
        top |= {"device": self.device, "resume": self.resume, "variant": self.variant}
        return top | {k: dataclasses.asdict(v) for k, v in self.sections.items()}


TOP_LEVEL = {"seed": 0, "deterministic": False, "device": "auto", "resume": "auto"}
TOP_TYPES = {"seed": int, "deterministic": bool, "device": Literal["auto", "cpu", "cuda"]}
TOP_TYPES["resume"] = str
TOP_RANGES = {"seed": Range(ge=0, lt=2**64)}  # seeds are mixed as 64-bit words (seeding.py)
YAML_NULLS = ("", "~", "null", "Null", "NULL")  # YAML's spellings of null, as in a file
# PyYAML raises more than YAMLError: ValueError for the date 2001-13-45 or an int too long to
# convert, RecursionError for deeply nested brackets.
YAML_FAILURES = (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError)


def _closest(key: str, options: typing.Iterable[str], prefix: str = "") -> str:
    options = list(options)
    match = difflib.get_close_matches(str(key), options, n=1, cutoff=0.5)  # YAML keys: any type
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return f"; valid keys: {', '.join(prefix + o for o in options)}"


def _check_type(path: str, value: Any, annotation: Any) -> Any:
    """Return value converted to `annotation`, or raise ConfigError naming `path`."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        value = _on_off(value, choices)
        if value not in choices or isinstance(value, bool) and True not in choices:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check_type(path, value, inner)
    if dataclasses.is_dataclass(annotation):  # a nested section, e.g. data.augment
        return build_section(path, annotation, value)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_check_type(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int | float) and not isinstance(value, bool):
        return _finite_float(path, value)
    if annotation is str and isinstance(value, int | float | datetime.date):
        # A YAML file's `name: 0123` is the int 83: refuse it rather than run as "83".
        raise ConfigError(
            f"{path}: expected str, got {value!r}; YAML read a number, boolean or date, "
            "so quote the value to keep it as written"
        )
    if annotation in (int, float) and isinstance(value, bool) or not isinstance(value, annotation):
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{path}: expected {name}, got {value!r}")
    return value


ON_OFF = {True: "on", False: "off", "true": "on", "false": "off"}


def _on_off(value: Any, choices: tuple) -> Any:
    """YAML 1.1 reads a bare `on`/`off` (and true/false) as booleans: for a field whose
    choices are on/off, they mean on/off (so `train.compile=true` keeps working)."""
    if isinstance(value, bool | str) and value in ON_OFF and ON_OFF[value] in choices:
        return ON_OFF[value]
    return value


def build_section(name: str, cls: type, values: dict[str, Any]) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        path = f"{name}.{key}"
        if key not in fields:  # !r: a key with a line break still prints as one line
            raise ConfigError(f"unknown config key {path!r}{_closest(key, fields, name + '.')}")
        kwargs[key] = _check_type(path, value, hints[key])
        _check_range(path, kwargs[key], fields[key].metadata.get("range"))
    return cls(**kwargs)


def _finite_float(path: str, value: int | float) -> float:
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{path} must be a finite number, got {value!r}")
    return number


def _check_range(path: str, value: Any, allowed: Range | None) -> None:
    """Raise ConfigError unless value (each item of a list; None passes) is in range."""
    if allowed is None or value is None:
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_range(f"{path}[{i}]", item, allowed)
    elif not allowed.admits(value):
        raise ConfigError(f"{path} must be {allowed}, got {value!r}")


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def parse_overrides(
    overrides: typing.Sequence[str], schema: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Dotted key=value overrides as a tree of values. `schema` maps top-level keys to their
    types (sections to dataclasses), so that each value is read by its field's type."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r} is not key=value (example: optim.lr=0.2)")
        _set_dotted(tree, key, _parse_value(raw, _declared_type(schema or {}, key)))
    return tree


def _declared_type(schema: dict[str, Any], dotted: str) -> Any:
    """The annotation of a dotted key, through nested sections; None for an unknown key."""
    node: Any = schema
    for part in dotted.split("."):
        if isinstance(node, type) and dataclasses.is_dataclass(node):
            node = typing.get_type_hints(node)
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


DECIMAL = re.compile(r"[+-]?[0-9]+")


def _parse_value(raw: str, annotation: Any) -> Any:
    """An override's text as a value for `annotation` (None: a key no section declares)."""
    if _is_text(annotation):
        return None if raw in YAML_NULLS and type(None) in _union_args(annotation) else raw
    if not raw:
        return ""
    if annotation == list[str]:
        return _text_list(raw)
    if int in _union_args(annotation) and DECIMAL.fullmatch(raw):
        try:
            return int(raw, 10)  # YAML 1.1 reads 010 as octal 8
        except ValueError:  # more digits than Python converts: left as text, named as such
            return raw
    try:
        value = yaml.safe_load(raw)
    except YAML_FAILURES:
        return raw  # left as text; the type check names the key
    if isinstance(value, str) and float in _union_args(annotation):
        try:
            return float(raw)  # YAML 1.1 reads 1e-3 (no dot) as text
        except ValueError:
            pass
    return value


def _text_list(raw: str) -> Any:
    """A list of text as written: `[fc.*=1, *=0.1]` is two patterns, although YAML reads a
    leading `*` as an alias (and a shell has already taken the quotes that would hide it)."""
    try:
        value = yaml.safe_load(raw)
    except YAML_FAILURES:
        value = None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    if raw.startswith("[") and raw.endswith("]"):
        items = (item.strip().strip("'\"") for item in raw[1:-1].split(","))
        return [item for item in items if item]
    return value if value is not None else raw


def _union_args(annotation: Any) -> tuple:
    """The members of a union (`str | None`: str and NoneType), or the annotation alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_text(annotation: Any) -> bool:
    """str, str | None or a Literal of strings: an override's text is the value as written."""

    def text(member: Any) -> bool:
        if typing.get_origin(member) is Literal:
            return all(isinstance(choice, str) for choice in typing.get_args(member))
        return member is str

    members = [m for m in _union_args(annotation) if m is not type(None)]
    return bool(members) and all(text(m) for m in members)


def merge(base: dict, update: dict) -> dict:
    """update layered over base, section by section."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except UnicodeDecodeError:  # before YAML_FAILURES, which holds its base, ValueError
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except YAML_FAILURES as err:
        raise ConfigError(f"{path}: not valid YAML ({_first_line(err)})") from None
    if data is None:  # an empty file, or only comments
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _first_line(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def description(path: Path) -> str:
    """The first comment line of a config file: what it trains, in one line."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def resolve(
    recipe: str,
    recipe_yaml: dict[str, Any],
    overrides: typing.Sequence[str],
    recipe_sections: dict[str, type],
    variant: str = "",
    variant_yaml: dict[str, Any] | None = None,
) -> Config:
    """Layer defaults < recipe_yaml < variant_yaml < overrides; validate every key and type."""
    if "model" in recipe_sections:  # every model section takes the fine-tuning keys
        recipe_sections = recipe_sections | {"model": with_weights_init(recipe_sections["model"])}
    section_types = ENGINE_SECTIONS | recipe_sections
    tree = parse_overrides(overrides, TOP_TYPES | section_types)
    merged = merge(merge(recipe_yaml, variant_yaml or {}), tree)
    valid = [*TOP_LEVEL, *RECORDED, *section_types]
    top = dict(TOP_LEVEL)
    sections = {}
    for key, value in merged.items():
        if key in RECORDED:
            _check_recorded(key, value, {"recipe": recipe, "variant": variant}[key])
        elif key in TOP_LEVEL:
            top[key] = _check_type(key, value, TOP_TYPES[key])
            _check_range(key, top[key], TOP_RANGES.get(key))
        elif key not in section_types:
            raise ConfigError(f"unknown config key {key!r}{_closest(key, valid)}")
    for name, cls in section_types.items():
        values = merged.get(name)  # `optim:` with nothing under it is an empty section
        sections[name] = build_section(name, cls, {} if values is None else values)
    cfg = Config(recipe=recipe, sections=sections, variant=variant, **top)
    validate(cfg)
    return cfg


RECORDED = ("recipe", "variant")  # in a resolved config: what it was resolved from


def _check_recorded(key: str, value: Any, chosen: str) -> None:
    """A saved config records its recipe and variant; both are chosen by name, so a recorded
    value must be the one chosen."""
    if (value or "") == chosen:
        return
    if key == "recipe":
        raise ConfigError(f"recipe={value!r} in the config, but the recipe run is {chosen!r}")
    raise ConfigError(
        f"variant={value!r}: a variant is chosen by name (CONFIG=NAME, --config NAME), "
        "not set as a key"
    )


def validate(cfg: Config) -> None:
    """Rules across fields; each field's own range is declared beside it (`bounded`)."""
    train, opt = cfg.train, cfg.optim
    if train.epochs < 1 and train.max_steps < 1:
        raise ConfigError("set train.epochs >= 1 or train.max_steps >= 1")
    if len(opt.betas) != 2:
        raise ConfigError(f"optim.betas needs two values, got {opt.betas}")
    sched = cfg.sched
    if sched.warmup_steps and sched.warmup_epochs or sched.milestones and sched.milestone_epochs:
        raise ConfigError("sched: give warmup (or milestones) in steps or in epochs, not both")
    if any(ch in cfg.run.name for ch in "/\\") or cfg.run.name in (".", ".."):
        raise ConfigError(f"run.name '{cfg.run.name}' must be a plain name, not a path")


def dump(cfg: Config) -> str:
    """The resolved config as YAML; loading it as a recipe config gives the same Config."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- the keys, described


@dataclass(frozen=True)
class KeyHelp:
    """One key as --help lists it."""

    key: str  # dotted, e.g. optim.lr
    kind: str  # its type: float, str | null, list[int], or a Literal's choices (on|off)
    default: str  # as YAML writes it
    range: str  # the valid range (Range.__str__), "" for none
    meaning: str  # from the comments beside the field (field_meanings)


def describe_section(prefix: str, cls: type) -> list[KeyHelp]:
    """The keys of a section (a nested section's as prefix.name.key), in declaration order."""
    hints = typing.get_type_hints(cls)
    meanings = field_meanings(cls)
    rows = []
    for f in dataclasses.fields(cls):
        key, annotation = f"{prefix}.{f.name}", hints[f.name]
        if dataclasses.is_dataclass(annotation):
            rows += describe_section(key, annotation)
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default
        allowed = f.metadata.get("range")
        meaning = meanings.get(f.name, "")
        rows.append(
            KeyHelp(key, type_name(annotation), show_value(default), str(allowed or ""), meaning)
        )
    return rows


def describe_top_level() -> list[KeyHelp]:
    """The top-level keys; their meanings are those of Config's fields."""
    meanings = field_meanings(Config)
    return [
        KeyHelp(
            key,
            type_name(TOP_TYPES[key]),
            show_value(default),
            str(TOP_RANGES.get(key) or ""),
            meanings.get(key, ""),
        )
        for key, default in TOP_LEVEL.items()
    ]


def type_name(annotation: Any) -> str:
    """A type as --help shows it: a Literal as its choices, None as YAML's null."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "|".join(map(str, typing.get_args(annotation)))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(member) for member in typing.get_args(annotation))
    if origin is list:
        return f"list[{type_name(typing.get_args(annotation)[0])}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def show_value(value: Any) -> str:
    """A value as YAML writes it in one line: null, true, '', [0.9, 0.999]."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
    return text.removesuffix("\n").removesuffix("\n...")


def class_summary(cls: type) -> str:
    """The first paragraph of the class's own docstring, in one line ("" for none: a
    dataclass without one gets a generated signature, which is not a summary)."""
    source = _class_source(cls)
    docstring = ast.get_docstring(ast.parse(source).body[0]) if source else None
    return " ".join((docstring or "").split("\n\n")[0].split())


def field_meanings(cls: type) -> dict[str, str]:
    """Each field's meaning, read from the comments in the class's source: the comment at the
    end of the field's line, else the comment lines just above it, joined into one line.
    "" for a field without one; {} when the source cannot be read."""
    found: dict[str, str] = {}
    for owner in [*reversed(cls.__mro__), getattr(cls, "meanings_from", object)]:
        if dataclasses.is_dataclass(owner) and "__dataclass_fields__" in vars(owner):
            found |= _own_meanings(owner)
    return found


def _own_meanings(cls: type) -> dict[str, str]:
    """The meanings of the fields declared in cls's own source."""
    source = _class_source(cls)
    if not source:
        return {}
    comments = _comments_by_line(source)
    body = ast.parse(source).body[0].body
    return {
        node.target.id: _meaning(node, comments)
        for node in body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def _class_source(cls: type) -> str:
    try:
        return textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return ""


def _comments_by_line(source: str) -> dict[int, tuple[bool, str]]:
    """line number -> (whether the comment fills its line, its text without the '#')."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            fills_line = not token.line[: token.start[1]].strip()
            found[token.start[0]] = (fills_line, token.string.lstrip("#").strip())
    return found


def _meaning(node: ast.AnnAssign, comments: dict[int, tuple[bool, str]]) -> str:
    for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
        fills_line, text = comments.get(number, (True, ""))
        if not fills_line:
            return text
    above: list[str] = []
    number = node.lineno - 1
    while comments.get(number, (False, ""))[0]:
        above.insert(0, comments[number][1])
        number -= 1
    return " ".join(above)
