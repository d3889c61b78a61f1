"""What takes a step: the optimizer, its schedule, the loss scaler and the precision."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parts import Part, saved, transient


@dataclass
class Optimisation(Part):
    # The optimizer's tensors are the checkpoint format's (sharded with the model by DCP).
    optimizer: torch.optim.Optimizer = transient()
    scheduler: torch.optim.lr_scheduler.LRScheduler = saved()
    scaler: torch.amp.GradScaler = saved()  # enabled for fp16 only
    amp_dtype: torch.dtype | None = transient(default=None)  # autocast's; None: off

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]
