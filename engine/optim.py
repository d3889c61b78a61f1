"""Optimizers and learning-rate schedules. Schedules count optimizer steps, so a recipe
trains the same on 1 or 64 processes (the global batch is fixed in the config)."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from engine.config import ConfigError, OptimConfig, SchedConfig
from engine.tracking import log

SHOWN = 5  # patterns listed in a start-up line


def base_lr(cfg: OptimConfig, batch_size: int) -> float:
    """optim.lr, scaled linearly with the global batch when lr_reference_batch is set."""
    return cfg.lr * batch_size / cfg.lr_reference_batch if cfg.lr_reference_batch else cfg.lr


def param_groups(model: nn.Module, cfg: OptimConfig, lr: float) -> list[dict]:
    """By default no weight decay on biases and normalization weights (1-d parameters).

    A model may mark a parameter with an `lr_scale` attribute (airbench's fast BN biases):
    it gets lr * lr_scale and weight_decay / lr_scale, so the decay per step is unchanged.
    optim.lr_mult's factor multiplies the rate alone (timm's layer-wise rates do the same)."""
    factors = lr_factors(model, cfg.lr_mult)
    groups: dict[tuple[bool, float, float], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            decays = cfg.decay_norm_bias or p.ndim > 1
            key = (decays, getattr(p, "lr_scale", 1.0), factors[name])
            groups.setdefault(key, []).append(p)
    return [
        {
            "params": params,
            "lr": lr * scale * factor,
            "weight_decay": cfg.weight_decay / scale * decays,
        }
        for (decays, scale, factor), params in sorted(
            groups.items(), key=lambda kv: (not kv[0][0], kv[0][1], -kv[0][2])
        )
    ]


def matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def check_patterns(key: str, patterns: list[str], names: Iterable[str]) -> None:
    """Every name pattern (fnmatch) matches a name: a typo must not silently change nothing."""
    names = list(names)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            top = sorted({name.split(".")[0] for name in names})
            raise ConfigError(
                f"{key}: {pattern!r} matches no tensor of the model; its names start with "
                f"{', '.join(top[:12])}{', ...' if len(top) > 12 else ''}"
            )


def lr_factors(model: nn.Module, entries: list[str]) -> dict[str, float]:
    """optim.lr_mult's "PATTERN=FACTOR" entries as {parameter name: factor} (1 unmatched)."""
    rules = [parse_lr_mult(entry) for entry in entries]
    names = [name for name, _ in model.named_parameters()]
    check_patterns("optim.lr_mult", [p for p, _ in rules], names)
    return {n: next((f for p, f in rules if fnmatch.fnmatchcase(n, p)), 1.0) for n in names}


def parse_lr_mult(entry: str) -> tuple[str, float]:
    pattern, sep, factor = entry.rpartition("=")
    try:
        value = float(factor)
    except ValueError:
        value = -1.0
    if not sep or not pattern or not value >= 0:  # `not >=`: NaN is refused too
        raise ConfigError(
            f"optim.lr_mult entry {entry!r} is not PATTERN=FACTOR with FACTOR >= 0 "
            "(e.g. optim.lr_mult=[fc.*=1,*=0.1])"
        )
    return pattern, value


def implementation(
    cfg: OptimConfig, device: torch.device, sharded: bool = False
) -> dict[str, bool]:
    """The optimizer's fused/foreach flags. Fused kernels exist for SGD and AdamW on CUDA and
    CPU (torch >= 2.4); elsewhere auto falls back to foreach. FSDP's sharded parameters
    (DTensors) have a fused AdamW but no fused SGD."""
    choice = cfg.implementation
    no_fused = sharded and cfg.name == "sgd"
    if choice == "fused" and no_fused:
        raise ConfigError(
            "optim.implementation=fused: SGD has no fused kernel for FSDP's sharded parameters; "
            "use optim.implementation=foreach (or auto)"
        )
    if choice == "auto":
        choice = "fused" if device.type in ("cuda", "cpu") and not no_fused else "foreach"
    return {"fused": choice == "fused", "foreach": choice == "foreach"}


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    batch_size: int,
    device: torch.device,
    sharded: bool = False,
) -> torch.optim.Optimizer:
    """sharded: the parameters are FSDP's DTensor shards (Strategy.shards). How the rates were
    set (scaled with the batch, per optim.lr_mult pattern) is said once, at start."""
    lr = base_lr(cfg, batch_size)
    groups = param_groups(model, cfg, lr)
    for line in (lr_scaling_line(cfg, batch_size), lr_groups_line(model, cfg, lr)):
        if line:
            note(line)
    flags = implementation(cfg, device, sharded)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **flags)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags)


def grad_norm_(params: list[nn.Parameter], max_norm: float, plain: bool) -> torch.Tensor:
    """The total 2-norm of the parameters' gradients, which are scaled down to max_norm when
    it is positive and exceeded: nn.utils.clip_grad_norm_(params, max_norm, foreach=True), or
    get_total_norm(grads, foreach=True) without clipping. `plain` (plain tensors of one device
    and dtype): the same kernels in the same order, so bit for bit the same, without the
    library's grouping by device and dtype, no_grad wrapper and copy call per tensor, which
    cost the step ~9 µs of host time for a Linear's two tensors (15 against 6 µs, on a CPU)
    and grow with the number of tensors: what a small model's step on a fast device notices."""
    grads = [p.grad for p in params]
    if not plain or not grads:
        if max_norm > 0:
            return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return nn.utils.get_total_norm(grads, foreach=True)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm > 0:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def lr_scaling_line(cfg: OptimConfig, batch_size: int) -> str:
    """optim.lr as scaled by optim.lr_reference_batch; "" when it is not."""
    if not cfg.lr_reference_batch:
        return ""
    return (
        f"optim.lr {cfg.lr:g} scaled to {base_lr(cfg, batch_size):g} for batch {batch_size} "
        f"(lr_reference_batch {cfg.lr_reference_batch})"
    )


def lr_groups_line(model: nn.Module, cfg: OptimConfig, lr: float) -> str:
    """optim.lr_mult's rates: each pattern's, then that of trainable tensors no pattern
    matches ("" without lr_mult). A tensor takes the first pattern that matches it."""
    if not cfg.lr_mult:
        return ""
    rules = [parse_lr_mult(entry) for entry in cfg.lr_mult]
    counts = [0] * (len(rules) + 1)  # the last: no pattern
    scaled = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        first = next(
            (i for i, (pattern, _) in enumerate(rules) if fnmatch.fnmatchcase(name, pattern)),
            len(rules),
        )
        counts[first] += 1
        scaled += getattr(p, "lr_scale", 1.0) != 1.0
    parts = [
        f"{pattern}={lr * factor:g} ({counts[i]} tensors)"
        for i, (pattern, factor) in enumerate(rules)
    ]
    if counts[-1]:
        parts.append(f"others={lr:g} ({counts[-1]} tensors)")
    own = f"; {scaled} tensors also scale it by their lr_scale" if scaled else ""
    return f"lr groups: {', '.join(parts)}{own}"


def rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def note(line: str) -> None:
    """A start-up note, said by rank 0 alone."""
    if rank_zero():
        log(line)


def in_steps(cfg: SchedConfig, steps_per_epoch: int) -> SchedConfig:
    """The schedule with warmup and milestones given in epochs converted to optimizer steps."""
    return dataclasses.replace(
        cfg,
        warmup_steps=cfg.warmup_steps or round(cfg.warmup_epochs * steps_per_epoch),
        warmup_epochs=0.0,
        milestones=cfg.milestones or [round(e * steps_per_epoch) for e in cfg.milestone_epochs],
        milestone_epochs=[],
    )


def lr_factor(step: int, total: int, cfg: SchedConfig) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based) of `total`."""
    if step < cfg.warmup_steps:
        return cfg.warmup_start + (1 - cfg.warmup_start) * (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "step":
        return cfg.gamma ** sum(step >= m for m in cfg.milestones)
    span = max(1, total - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 1 - progress if cfg.name == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(opt: torch.optim.Optimizer, total: int, cfg: SchedConfig, steps_per_epoch: int):
    steps = in_steps(cfg, steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, total, steps))


# ---------------------------------------------------------------- what trains


def freeze_parameters(model: nn.Module, patterns: list[str]) -> None:
    """optim.freeze: matching parameters take no gradient (and so no optimizer state)."""
    if not patterns:
        return
    named = dict(model.named_parameters())  # the bare model: set-up freezes before wrapping
    check_patterns("optim.freeze", patterns, named)
    frozen = [name for name in named if matches(name, patterns)]
    for name in frozen:
        named[name].requires_grad_(False)
    note(frozen_line(patterns, len(frozen), len(named)))


def frozen_line(patterns: list[str], frozen: int, tensors: int) -> str:
    """optim.freeze in one line: how many patterns, the tensors they froze, the patterns."""
    shown = ", ".join(patterns[:5]) + (", ..." if len(patterns) > 5 else "")
    plural = "s" if len(patterns) > 1 else ""
    return f"frozen: {len(patterns)} pattern{plural}, {frozen} of {tensors} tensors ({shown})"
