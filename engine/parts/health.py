"""What went wrong along the way and was survived: unreadable samples replaced
(data.skip_bad), steps skipped for non-finite gradients (train.nan_policy=skip), and the
device-side record that nan_policy=stop reads without a host sync per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parts import Part, saved, transient


@dataclass
class Health(Part):
    skip_bad: bool = transient(default=False)  # data.skip_bad: replace unreadable samples
    pending_bad: int = transient(default=0)  # this rank's replaced samples not yet summed
    # First step whose gradients were not finite (0: none), kept on the device so that the
    # check costs no host sync per step; read at log intervals and before every checkpoint.
    first_bad_step: torch.Tensor | None = transient(default=None)
    unchecked_norms: list[torch.Tensor] = transient(default_factory=list)  # since the check
    bad_samples: int = saved(default=0)  # replaced so far, summed over ranks
    skipped_steps: int = saved(default=0)
