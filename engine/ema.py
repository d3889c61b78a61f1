"""An exponential moving average of the weights, with torch's AveragedModel.

Checkpoints keep the averaged weights bare (no `module.` prefix, loadable as a model on its
own) and `n_averaged`, so a resumed run continues the average bit for bit."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from engine.config import EmaConfig


def build_ema(model: nn.Module, cfg: EmaConfig) -> AveragedModel | None:
    """The average of the bare model (on its device), buffers (BN statistics) included."""
    if cfg.decay <= 0:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.decay), use_buffers=True)


@torch.no_grad()
def update_ema(ema: AveragedModel | None, model: nn.Module, step: int, cfg: EmaConfig) -> None:
    """After optimizer step `step` (1-based): every `every_steps`; a copy during warmup, as
    torchvision's reference does, so the average starts from trained weights."""
    if ema is None or step % cfg.every_steps:
        return
    if step <= cfg.warmup_steps:
        ema.n_averaged.zero_()  # AveragedModel copies the weights when n_averaged is 0
    ema.update_parameters(model)


def ema_state(ema: AveragedModel) -> dict:
    return {"model": ema.module.state_dict(), "n_averaged": ema.n_averaged.detach().cpu()}


def load_ema_state(ema: AveragedModel, state: dict) -> None:
    ema.module.load_state_dict(state["model"])
    ema.n_averaged.copy_(state["n_averaged"])
