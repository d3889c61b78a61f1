"""An exponential moving average of the weights, with torch's AveragedModel.

Checkpoints keep the averaged weights bare (no `module.` prefix, loadable as a model on its
own) and `n_averaged`, so a resumed run continues the average bit for bit."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from engine.config import EmaConfig


def build_ema(model: nn.Module, cfg: EmaConfig) -> AveragedModel | None:
    """The average of the bare model (on its device), buffers (BN statistics) included.
    Its count `n_averaged` stays on the CPU (AveragedModel makes it there): update_ema reads
    it every update, which costs no device sync there."""
    if cfg.decay <= 0:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.decay), use_buffers=True)


@torch.no_grad()
def update_ema(ema: AveragedModel | None, model: nn.Module, step: int, cfg: EmaConfig) -> None:
    """After optimizer step `step` (1-based): every `every_steps`; a copy during warmup, as
    torchvision's reference does, so the average starts from trained weights.

    AveragedModel.update_parameters's arithmetic, without its copy of n_averaged to the
    device (a blocking copy every update, which the EMA function never reads): a copy while
    n_averaged is 0, else the EMA function on each group of one device and dtype."""
    if ema is None or step % cfg.every_steps:
        return
    if step <= cfg.warmup_steps:
        ema.n_averaged.zero_()  # copy the weights, as AveragedModel does when n_averaged is 0
    averaged = [*ema.module.parameters(), *ema.module.buffers()]
    current = [t.detach() for t in (*model.parameters(), *model.buffers())]
    if len(averaged) != len(current):
        raise ValueError("the EMA's module and the model hold different tensors")
    if int(ema.n_averaged) == 0:  # a CPU tensor: no device sync
        for a, c in zip(averaged, current, strict=True):
            a.detach().copy_(c.to(a.device))
    else:
        groups: dict[tuple, tuple[list, list]] = {}
        for a, c in zip(averaged, current, strict=True):
            mine, theirs = groups.setdefault((a.device, a.dtype), ([], []))
            mine.append(a.detach())
            theirs.append(c.to(a.device))
        for mine, theirs in groups.values():
            ema.multi_avg_fn(mine, theirs, None)  # the EMA function ignores the count
    ema.n_averaged += 1


def ema_state(ema: AveragedModel) -> dict:
    return {"model": ema.module.state_dict(), "n_averaged": ema.n_averaged.detach().cpu()}


def load_ema_state(ema: AveragedModel, state: dict) -> None:
    ema.module.load_state_dict(state["model"])
    ema.n_averaged.copy_(state["n_averaged"])
