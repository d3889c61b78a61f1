"""What went wrong along the way and was survived: unreadable samples replaced
(data.skip_bad), steps skipped for non-finite gradients (train.nan_policy=skip), and the
device-side record that nan_policy=stop reads without a host sync per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import distributed as D
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

    def note_replaced(self, micro_batches: list) -> None:
        """data.skip_bad: this rank's samples replaced in a step, summed later over ranks."""
        if self.skip_bad:
            self.pending_bad += sum(int(b.replaced.sum()) for b in micro_batches)

    def add_replaced(self, summed: int) -> None:
        """The ranks' pending replaced samples, summed (by the caller's collective)."""
        self.bad_samples += summed
        self.pending_bad = 0

    def sum_replaced(self, device: torch.device) -> None:
        """Sum the ranks' pending replaced-sample counts (a collective with skip_bad)."""
        if self.skip_bad:
            pending = torch.full((1,), float(self.pending_bad), device=device)
            self.add_replaced(int(D.all_reduce_sum(pending).item()))

    def note_bad_steps(self, step: int) -> None:
        """nan_policy=stop: the first step among the unchecked norms (those of the steps up to
        `step`) whose gradients were not finite into first_bad_step, unless one is there
        already: a few operations per window on the device, none per step, no host sync."""
        norms, self.unchecked_norms = self.unchecked_norms, []
        if not norms:
            return
        bad = ~torch.isfinite(torch.stack(norms))
        first = step - len(norms) + 1
        found = first + torch.argmax(bad.to(torch.uint8))  # argmax: the first of equal maxima
        new = bad.any() & (self.first_bad_step == 0)
        self.first_bad_step = torch.where(new, found, self.first_bad_step)
