"""What the run writes about itself: metrics through the tracker, the last evaluation, the
best checkpoints' ranking, and the code, data and config that wrote each checkpoint. (What the
process holds, a lock or a writer, is engine.run.Held.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import config as C
from engine.parts import Part, recorded, saved, transient
from engine.redact import redact
from engine.tracking import NullTracker, Tracker


@dataclass
class Speed:
    """What turns samples/s into the figures logged beside it (engine.meter)."""

    flops_per_sample: float = 0.0  # training FLOPs (forward + backward); 0: unknown
    peak_flops: float = 0.0  # of all devices together; 0: unknown (no MFU)
    units_per_sample: int = 0  # the task's units (e.g. tokens) per sample; 0: not declared
    warned_data_wait: bool = False  # the starvation warning is said once per run


@dataclass
class Records(Part):
    tracker: Tracker | NullTracker = transient(default_factory=NullTracker)
    speed: Speed = transient(default_factory=Speed)
    config: C.Config | None = transient(default=None)  # recorded redacted by state_dict
    code: dict = recorded(default_factory=dict)  # engine.codeid's identity of the code running
    # engine.data.fingerprint's fingerprints of the training and held-out data
    data: dict = recorded(default_factory=dict)
    last_eval: dict = saved(default_factory=dict)
    best: list = saved(default_factory=list)  # best checkpoints, best first (checkpoint.best)

    def state_dict(self) -> dict[str, Any]:
        """With the config that wrote the checkpoint, as it is at the save (never a pasted
        credential): a resume compares its own with it (engine.checkpoint.state)."""
        out = super().state_dict()
        if self.config is not None:
            out["config"] = redact(self.config.to_dict())
        return out
