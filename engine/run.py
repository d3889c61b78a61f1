"""A run as engine.assemble assembles it: the decisions taken at set-up, and its state in owned
parts (engine.parts), each saving and restoring itself.

The loop (engine.train), evaluation (engine.evaluate), metering (engine.meter) and checkpoints
(engine.checkpoint.state) read the same Run; a checkpoint is the sum of its parts' state
dicts (state_dict below) and a resume hands each part the same dict back."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import config as C
from engine import distributed as D
from engine import recipe as contract
from engine import rundir
from engine.data.prefetch import Finished
from engine.data.stages import STAGES
from engine.parts import Part
from engine.parts.feed import Feed
from engine.parts.health import Health
from engine.parts.network import Network
from engine.parts.optimisation import Optimisation
from engine.parts.progress import Progress
from engine.parts.records import Records
from engine.recipe import Recipe
from engine.tasks import Task


@dataclass
class Held:
    """What the process holds while the run lives, none of it the run's state (nothing here
    is saved or recorded): rank 0's lock on the run directory, the background checkpoint
    writer (ckpt.async_save: engine.checkpoint.sharded.BackgroundWriter), and the profiler
    while fit() runs (engine.profile.Profiling). Run.close() lets go of them."""

    lock_fd: int | None = None
    writer: Any = None
    profiling: Any = None


@dataclass
class Run:
    cfg: C.Config
    recipe: Recipe
    task: Task  # what the loss and the evaluation metrics are
    denv: D.DistEnv
    device: torch.device
    run_dir: Path
    net: Network
    opt: Optimisation
    feed: Feed
    progress: Progress
    health: Health
    records: Records

    def __post_init__(self) -> None:
        # Not a field: what the process holds is neither a decision nor a part of the run.
        self.held = Held()

    def parts(self) -> tuple[Part, ...]:
        return (self.net, self.opt, self.feed, self.progress, self.health, self.records)

    def state_dict(self) -> dict[str, Any]:
        """Every part's state, in one flat dict (a collective: the RNG streams of all
        ranks). Two parts writing the same key would lose one of them: refused."""
        merged: dict[str, Any] = {}
        for part in self.parts():
            state = part.state_dict()
            clash = merged.keys() & state.keys()
            if clash:
                raise RuntimeError(f"{type(part).__name__} saves {sorted(clash)} again")
            merged |= state
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts():
            part.load_state_dict(state)

    def close(self) -> None:
        """Ends what runs beside the loop, in order: the thread finishing batches ahead (it
        runs device code, which must not outlive the interpreter), a checkpoint still being
        written after an error (waited for; published if complete: engine.checkpoint.sharded),
        then the hold on the run directory, free for the next launch."""
        if hasattr(self.feed.loader, "close"):
            self.feed.loader.close()
        if self.held.writer is not None:
            self.held.writer.close()
        if self.held.lock_fd is not None:
            rundir.release(self.held.lock_fd)
            self.held.lock_fd = None

    def autocast(self):
        if self.opt.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.opt.amp_dtype)

    def to_device(self, x, y: torch.Tensor, dataset) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the device, in the model's memory format. A dataset may finish its
        batches there (`finish_on_device`: uint8 images normalised, or JPEG bytes decoded);
        a batch the loader finished ahead (engine.data.prefetch) is taken as it is."""
        with STAGES.timing("to_device"):
            finish = contract.device_finisher(dataset)
            if isinstance(x, Finished):
                x = x.tensor
            elif finish:
                x = finish(x, self.device)
            else:
                x = x.to(self.device, non_blocking=True)
            if x.ndim == 4:
                x = x.contiguous(memory_format=self.net.layout)
            return x, y.to(self.device, non_blocking=True)
