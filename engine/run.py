"""A run as engine.setup assembles it, and where its training stands.

The loop (engine.train), evaluation (engine.evaluate), metering (engine.meter) and checkpoints
(engine.checkpoint.state) read the same Run; each section of the config is read where it is
used, and every decision taken at set-up (strategy, precision, layout) is a field here."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine import config as C
from engine import distributed as D
from engine import rundir
from engine.data.mix import BatchMix
from engine.data.prefetch import Finished
from engine.data.sampler import GlobalBatchSampler
from engine.parallel import Strategy
from engine.recipe import Recipe
from engine.tasks import Task
from engine.tracking import NullTracker, Tracker


@dataclass
class State:
    """Where training stands: enough, with the checkpointed states, to resume bit for bit."""

    epoch: int = 0
    step: int = 0  # optimizer steps done
    position: int = 0  # global samples consumed in the current epoch
    last_eval: dict = field(default_factory=dict)
    bad_samples: int = 0  # unreadable files replaced so far, summed over ranks (data.skip_bad)
    skipped_steps: int = 0  # optimizer steps skipped for non-finite gradients (nan_policy=skip)
    best: list = field(default_factory=list)  # best checkpoints, best first (checkpoint.best)

    def epoch_number(self) -> int:
        """The epoch in progress, or the one just completed when at its end, counted from 1:
        what the log says (records and checkpoints keep `epoch`, the epochs completed)."""
        return self.epoch + 1 if self.position > 0 else max(self.epoch, 1)


@dataclass
class Speed:
    """What turns samples/s into the figures logged beside it (engine.meter)."""

    flops_per_sample: float = 0.0  # training FLOPs (forward + backward); 0: unknown
    peak_flops: float = 0.0  # of all devices together; 0: unknown (no MFU)
    units_per_sample: int = 0  # the task's units (e.g. tokens) per sample; 0: not declared
    warned_data_wait: bool = False  # the starvation warning is said once per run


@dataclass
class Run:
    cfg: C.Config
    recipe: Recipe
    denv: D.DistEnv
    device: torch.device
    strategy: Strategy
    run_dir: Path
    model: nn.Module  # wrapped for training (DDP/DP/compiled), sharded (FSDP) or bare
    bare: nn.Module  # the recipe's module (under FSDP: with sharded parameters)
    eval_model: nn.Module  # the bare model, compiled when training is
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: GlobalBatchSampler
    loader: torch.utils.data.DataLoader  # built once, so persistent workers persist
    train_data: torch.utils.data.Dataset
    eval_data: torch.utils.data.Dataset
    task: Task  # what the loss and the evaluation metrics are
    total_steps: int
    amp_dtype: torch.dtype | None
    tracker: Tracker | NullTracker
    state: State
    speed: Speed
    ema: torch.optim.swa_utils.AveragedModel | None = None
    mix: BatchMix | None = None
    skip_bad: bool = False
    pending_bad: int = 0  # this rank's replaced samples not yet summed into state.bad_samples
    lock_fd: int | None = None  # rank 0's hold on the run directory, released when it exits
    # First step whose gradients were not finite (0: none), kept on the device so that the
    # check costs no host sync per step; read at log intervals and before every checkpoint.
    first_bad_step: torch.Tensor | None = None
    unchecked_norms: list[torch.Tensor] = field(default_factory=list)  # steps since the check
    memory_format: torch.memory_format = torch.contiguous_format  # of 4-d input batches
    trainable: list[nn.Parameter] = field(default_factory=list)  # the bare model's, listed once
    init_record: dict | None = None  # the first weights' file (engine.finetune), if any
    code: dict = field(default_factory=dict)  # engine.codeid's identity of the code running

    def close(self) -> None:
        """Ends what runs beside the loop, in order: the thread finishing batches ahead (it
        runs device code, which must not outlive the interpreter), then the hold on the run
        directory, free for the next launch."""
        if hasattr(self.loader, "close"):
            self.loader.close()
        if self.lock_fd is not None:
            rundir.release(self.lock_fd)
            self.lock_fd = None

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def to_device(self, x, y: torch.Tensor, dataset) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the device, in the model's memory format. A dataset may finish its
        batches there (`finish_on_device`: uint8 images normalised, or JPEG bytes decoded);
        a batch the loader finished ahead (engine.data.prefetch) is taken as it is."""
        finish = getattr(dataset, "finish_on_device", None)
        if isinstance(x, Finished):
            x = x.tensor
        elif finish:
            x = finish(x, self.device)
        else:
            x = x.to(self.device, non_blocking=True)
        if x.ndim == 4:
            x = x.contiguous(memory_format=self.memory_format)
        return x, y.to(self.device, non_blocking=True)
