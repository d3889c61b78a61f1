"""Where training stands: epoch, step, the position in the epoch, and every rank's random
streams. With the other parts' states, enough to resume bit for bit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine import distributed as D
from engine.parts import Part, recorded, saved, transient
from engine.seeding import derive_seed, rng_state, seed_process, set_rng_state


@dataclass
class Progress(Part):
    total_steps: int = transient(default=0)  # the run's length, from the config
    seed: int = transient(default=0)  # what fresh streams derive from on another world size
    rank: int = transient(default=0)
    world_size: int = recorded(default=1)  # a resume on another one reseeds (load_state_dict)
    epoch: int = saved(default=0)  # epochs completed
    step: int = saved(default=0)  # optimizer steps done
    position: int = saved(default=0)  # global samples consumed in the current epoch
    # The run's seconds before this start, up to the checkpoint it resumes from: a run's time
    # is the sum of its starts (a requeued run's summary is not its last start's alone).
    seconds: float = saved(default=0.0)
    started: float = transient(default_factory=time.perf_counter)  # this start's beginning

    def epoch_number(self) -> int:
        """The epoch in progress, or the one just completed when at its end, counted from 1:
        what the log says (records and checkpoints keep `epoch`, the epochs completed)."""
        return self.epoch + 1 if self.position > 0 else max(self.epoch, 1)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        """A collective: every rank's RNG states, gathered to every rank (rank 0 writes them,
        or each rank the same meta beside its shards)."""
        return super().state_dict() | {
            "rng": D.gather_objects(rng_state()),
            "time": time.time(),
            "seconds": self.total_seconds(),
        }

    def total_seconds(self) -> float:
        """The run's seconds so far: its earlier starts' and this one's."""
        return self.seconds + time.perf_counter() - self.started

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state["world_size"] == self.world_size:
            set_rng_state(state["rng"][self.rank])
        else:  # a different world size: fresh per-rank streams, still a function of the step
            seed_process(derive_seed(self.seed, state["step"]), self.rank)
