"""Optimizers and learning-rate schedules. Schedules count optimizer steps, so a recipe
trains the same on 1 or 64 processes (the global batch is fixed in the config)."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import OptimConfig, SchedConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    # No weight decay on biases and normalization weights (1-d parameters).
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_factor(step: int, total: int, cfg: SchedConfig) -> float:
    """Multiplier of optim.lr at optimizer step `step` (0-based) of `total`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "step":
        return cfg.gamma ** sum(step >= m for m in cfg.milestones)
    span = max(1, total - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, total: int, cfg: SchedConfig):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, total, cfg))
