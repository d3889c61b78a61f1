"""Typed configuration: engine defaults < recipe config.yaml < dotted CLI overrides.

Every section is a dataclass; a builder receives only its own section. Validation happens
before anything is written, and every mistake is reported as one line (ConfigError)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A user mistake in the configuration; the CLI prints it as one line and exits 2."""


@dataclass
class RunConfig:
    name: str = ""  # empty: a new time-stamped name per launch
    root: str = "runs"
    # resume=none on a run directory that holds a run: move its contents aside into
    # <name>.replaced-<time> and start afresh (without it, such a launch is refused).
    overwrite: bool = False


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: int = 0  # > 0: train this many optimizer steps instead of `epochs`
    stop_at_step: int = 0  # > 0: checkpoint and stop after this step (the schedule is unchanged)
    batch_size: int = 64  # global: summed over processes and accumulation steps
    micro_batch_size: int | None = None  # per process; sets accumulation steps
    grad_clip: float = 0.0
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA, off on CPU
    channels_last: bool = False
    compile: bool = False
    label_smoothing: float = 0.0  # training loss only; evaluation reports plain cross entropy
    # Non-finite gradients (without fp16, whose scaler skips such steps itself): stop before
    # the next checkpoint, naming the step, or skip the step and count it.
    nan_policy: Literal["stop", "skip"] = "stop"


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    # > 0: optim.lr is the rate for a global batch of this size and scales linearly with
    # train.batch_size (the linear scaling rule); the global batch, not the GPU count, decides.
    lr_reference_batch: int = 0
    decay_norm_bias: bool = False  # also apply weight decay to norm weights and biases


@dataclass
class SchedConfig:
    """Counted in optimizer steps; the *_epochs forms are converted with the steps per epoch."""

    name: Literal["cosine", "linear", "step", "constant"] = "cosine"
    warmup_steps: int = 0
    warmup_epochs: float = 0.0  # alternative to warmup_steps
    warmup_start: float = 0.0  # lr factor at the first step of warmup (torchvision: 0.01)
    min_lr_ratio: float = 0.0  # cosine/linear floor, as a fraction of optim.lr
    milestones: list[int] = field(default_factory=list)  # step schedule, in optimizer steps
    milestone_epochs: list[float] = field(default_factory=list)  # alternative to milestones
    gamma: float = 0.1


@dataclass
class LoaderConfig:
    num_workers: int = 0
    pin_memory: bool = True  # only takes effect on CUDA
    persistent_workers: bool = True
    prefetch_factor: int = 2
    # Also seed python's `random` and numpy per sample, for augmentations that draw from them
    # (torch's RNG is always seeded per sample).
    seed_python_numpy: bool = False


@dataclass
class EvalConfig:
    every_epochs: int = 1
    batch_size: int = 256  # per process
    hflip_tta: bool = False  # average the logits of each image and its mirror


@dataclass
class MixConfig:
    """MixUp/CutMix on training batches (torchvision.transforms.v2), one of them per micro
    batch when both are on; partners and lambda are a function of (seed, epoch, position)."""

    mixup_alpha: float = 0.0  # 0: off
    cutmix_alpha: float = 0.0  # 0: off


@dataclass
class EmaConfig:
    """An exponential moving average of the weights (torch.optim.swa_utils.AveragedModel),
    evaluated beside the model and kept in checkpoints."""

    decay: float = 0.0  # per update; 0: off
    every_steps: int = 1  # update after every this many optimizer steps
    warmup_steps: int = 0  # before this step the average just copies the weights


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end of each epoch
    keep: int = 3


@dataclass
class LogConfig:
    every_steps: int = 10  # also how often ranks agree on a preemption signal
    wandb: Literal["auto", "online", "offline", "off"] = "auto"
    project: str = "recipes"
    entity: str | None = None
    progress: Literal["auto", "bar", "plain", "off"] = "auto"
    sample_ids: bool = False  # write each step's global sample ids to samples.jsonl (tests)


@dataclass
class DistConfig:
    strategy: Literal["auto", "ddp", "dp", "none"] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    init_method: str = "env://"  # or tcp://host:port, file:///shared/path
    timeout_s: float = 600.0
    sync_bn: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = True


@dataclass
class FaultConfig:
    """Deliberate failures, for fault tests and for rehearsing what a crash looks like."""

    raise_at_step: int = 0  # > 0: raise an error after this optimizer step
    rank: int = 0  # on this global rank only
    # The ones below act only in a process's first attempt (not after a torchrun restart).
    signal_at_step: int = 0  # > 0: send `signal` to this process after this step
    signal: Literal["SIGKILL", "SIGTERM", "SIGINT", "SIGUSR2"] = "SIGKILL"
    hang_at_step: int = 0  # > 0: stop responding (sleep) after this step, as a hung rank does
    hang_in_save_at_step: int = 0  # > 0: stall mid-write of this step's checkpoint
    nan_at_step: int = 0  # > 0: this step's loss (and so its gradients) is NaN, every attempt


@dataclass
class SlurmConfig:
    """Read by launch/ when submitting; validated here like every other section."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    constraint: str | None = None
    exclude: str | None = None
    setup: list[str] = field(default_factory=list)
    signal_delay_s: int = 120  # SIGUSR2 this many seconds before the time limit
    max_requeues: int = 20  # stop requeueing a job that was requeued this often


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
class Config:
    recipe: str
    seed: int
    deterministic: bool
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
        top = {"seed": self.seed, "deterministic": self.deterministic, "device": self.device}
        top |= {"resume": self.resume, "variant": self.variant}
        return top | {k: dataclasses.asdict(v) for k, v in self.sections.items()}


TOP_LEVEL = {"seed": 0, "deterministic": False, "device": "auto", "resume": "auto"}
TOP_TYPES = {"seed": int, "deterministic": bool, "device": Literal["auto", "cpu", "cuda"]}
TOP_TYPES["resume"] = str


def _closest(key: str, options: typing.Iterable[str], prefix: str = "") -> str:
    options = list(options)
    match = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return f"; valid keys: {', '.join(prefix + o for o in options)}"


def _check_type(path: str, value: Any, annotation: Any) -> Any:
    """Return value converted to `annotation`, or raise ConfigError naming `path`."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value is False and "off" in choices:  # YAML 1.1 reads a bare `off` as false
            value = "off"
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
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if annotation in (int, float) and isinstance(value, bool) or not isinstance(value, annotation):
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{path}: expected {name}, got {value!r}")
    return value


def build_section(name: str, cls: type, values: dict[str, Any]) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(
                f"unknown config key '{name}.{key}'{_closest(key, known, name + '.')}"
            )
        kwargs[key] = _check_type(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node = child
    node[leaf] = value


def parse_overrides(overrides: typing.Sequence[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override '{item}' is not key=value (example: optim.lr=0.2)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    return tree


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
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


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
    merged = merge(merge(recipe_yaml, variant_yaml or {}), parse_overrides(overrides))
    section_types = ENGINE_SECTIONS | recipe_sections
    valid = [*TOP_LEVEL, "variant", *section_types]
    top = dict(TOP_LEVEL)
    sections = {}
    for key, value in merged.items():
        if key == "variant":  # recorded in resolved configs; chosen only by name
            if (value or "") != variant:
                raise ConfigError(
                    f"variant={value!r}: a variant is chosen by name (CONFIG=NAME, --config NAME), "
                    "not set as a key"
                )
        elif key in TOP_LEVEL:
            top[key] = _check_type(key, value, TOP_TYPES[key])
        elif key not in section_types:
            raise ConfigError(f"unknown config key '{key}'{_closest(key, valid)}")
    for name, cls in section_types.items():
        sections[name] = build_section(name, cls, merged.get(name) or {})
    cfg = Config(recipe=recipe, sections=sections, variant=variant, **top)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Value checks that the types alone cannot express."""
    train, opt = cfg.train, cfg.optim
    if train.batch_size < 1:
        raise ConfigError(f"train.batch_size must be >= 1, got {train.batch_size}")
    if train.micro_batch_size is not None and train.micro_batch_size < 1:
        raise ConfigError(f"train.micro_batch_size must be >= 1, got {train.micro_batch_size}")
    if train.epochs < 1 and train.max_steps < 1:
        raise ConfigError("set train.epochs >= 1 or train.max_steps >= 1")
    if opt.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {opt.lr}")
    if len(opt.betas) != 2:
        raise ConfigError(f"optim.betas needs two values, got {opt.betas}")
    if cfg.ckpt.keep < 1:
        raise ConfigError(f"ckpt.keep must be >= 1, got {cfg.ckpt.keep}")
    if cfg.loader.num_workers < 0:
        raise ConfigError(f"loader.num_workers must be >= 0, got {cfg.loader.num_workers}")
    if cfg.log.every_steps < 1:
        raise ConfigError(f"log.every_steps must be >= 1, got {cfg.log.every_steps}")
    if not 0 <= cfg.train.label_smoothing < 1:
        raise ConfigError(
            f"train.label_smoothing must be in [0, 1), got {cfg.train.label_smoothing}"
        )
    if cfg.mix.mixup_alpha < 0 or cfg.mix.cutmix_alpha < 0:
        raise ConfigError("mix.mixup_alpha and mix.cutmix_alpha must be >= 0 (0 turns one off)")
    if not 0 <= cfg.ema.decay < 1 or cfg.ema.every_steps < 1:
        raise ConfigError("ema.decay must be in [0, 1) (0: off) and ema.every_steps >= 1")
    sched = cfg.sched
    if sched.warmup_steps and sched.warmup_epochs or sched.milestones and sched.milestone_epochs:
        raise ConfigError("sched: give warmup (or milestones) in steps or in epochs, not both")
    if any(ch in cfg.run.name for ch in "/\\") or cfg.run.name in (".", ".."):
        raise ConfigError(f"run.name '{cfg.run.name}' must be a plain name, not a path")


def dump(cfg: Config) -> str:
    """The resolved config as YAML; loading it as a recipe config gives the same Config."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
