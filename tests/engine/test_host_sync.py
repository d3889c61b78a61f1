"""The training step never waits for the device: no call on the step path reads a device
tensor back to the host, copies Python data or pageable memory to the device blocking, or
asks for a data-dependent shape (nonzero, boolean masks). A logging step reads its window
back once; checkpoints and evaluation (epoch ends) may sync as they need.

Run on the CPU, so the test has to say which tensors would live on the accelerator. The run
is set up on torch.device("cpu", 0), which the engine treats as any other device and a
torch function mode (torch.overrides.TorchFunctionMode) can tell apart from the plain CPU;
under the mode a device tensor's `.device` is that device too:

- device tensors: the run's state on its device when the steps begin (the weights and
  buffers of the model and of its EMA, optimizer state, first_bad_step, an on-device
  dataset's tensors), tensors made with an explicit `device=`, tensors moved with
  .to(<the run's device>), and whatever an operation makes from at least one device tensor;
- host tensors: every other tensor made before the steps (a CPU dataset, EMA's
  `n_averaged`, which AveragedModel keeps on the CPU, torchvision's mixing distributions),
  tensors made during the steps without a device (the sampler's permutation, the loader's
  batches, RNG states), moved with .cpu() or .to("cpu"), and whatever is made from host
  tensors only.

A call counts as a sync when it reads a device tensor on the host (item, tolist, bool, int,
float, index, cpu, numpy, formatting), builds a device tensor from Python data
(torch.tensor/as_tensor with a device), copies host memory to the device without
non_blocking, or needs the device's data for a shape (nonzero, masked_select, unique,
repeat_interleave without output_size, indexing by a boolean device tensor). Each is
attributed to the step whose work is under way (from the loader's first micro batch of a
step to that of the next), with its stack. The mode sees calls made from Python: a sync
inside one of torch's own C++ operators would not show here."""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
from dataclasses import dataclass, field

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from bench.common import StepClock  # stands in for the progress display
from engine import distributed as D
from engine import train as T
from engine.assemble import setup
from engine.catalog import load_config
from engine.data.device import DeviceLoader
from tests.datagen_cifar import write_cifar_batches

RUN_DEVICE = torch.device("cpu", 0)
DEVICE_OF = torch.Tensor.device.__get__
READS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__format__",
    "__repr__",
    "__str__",
    "__array__",
    "cpu",
    "numpy",
}
SHAPE_FROM_DATA = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
MOVES = {"to", "cuda", "copy_"}
MARK = "_host_sync_test_host"  # True or absent: host tensor; False: device tensor


def is_host(t: torch.Tensor) -> bool:
    return getattr(t, MARK, True)


def mark(out, host: bool) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, MARK, host)


def tensors_in(args, kwargs) -> list[torch.Tensor]:
    flat = tree_flatten((args, kwargs))[0]
    return [a for a in flat if isinstance(a, torch.Tensor)]


def names_device(args, kwargs) -> bool | None:
    """Whether a .to() call moves to the run's device (True), to the host (False), or names
    no device (None: a dtype). The string "cpu" and a host tensor name the host; a device
    object names the run's device: the engine passes run.device, a device tensor reports it
    (DEVICE_OF), and torch's own code passes devices it took from tensors in C++, which
    read as the plain CPU here (a host tensor moved with a host tensor's .device object,
    a no-op, would be counted: the step path has none)."""
    for a in [*args[1:], kwargs.get("device")]:
        if isinstance(a, str):
            return torch.device(a) == RUN_DEVICE
        if isinstance(a, torch.device):
            return True
        if isinstance(a, torch.Tensor):  # .to(other): other's device and dtype
            return not is_host(a)
    return None


@dataclass
class Sync:
    step: int
    what: str
    stack: str


@dataclass
class Watch(TorchFunctionMode):
    """Classifies tensors as device or host and records the calls that would sync."""

    step: int = 0
    syncs: list[Sync] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def flag(self, what: str) -> None:
        watch = ("flag", "check", "__torch_function__")
        frames = [
            f
            for f in traceback.extract_stack()
            if not (f.filename == __file__ and f.name in watch)
            and not f.filename.endswith("torch/overrides.py")
            and "/_pytest/" not in f.filename
            and "/pluggy/" not in f.filename
        ]
        where = "".join(traceback.format_list(frames[-8:]))
        self.syncs.append(Sync(self.step, what, where))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_OF and not is_host(args[0]):
            return RUN_DEVICE  # so that .to(t.device) and device=t.device name the device
        name = getattr(func, "__name__", str(func))
        inputs = tensors_in(args, kwargs)
        on_device = [t for t in inputs if not is_host(t)]
        self.check(func, name, args, kwargs, on_device)
        out = func(*args, **kwargs)
        if name in ("cpu", "numpy"):
            host = True
        elif name in ("to", "cuda") and inputs and inputs[0] is args[0]:
            dest = True if name == "cuda" else names_device(args, kwargs)
            host = is_host(args[0]) if dest is None else not dest
        elif not inputs:  # a factory: on the device only when told so
            host = kwargs.get("device") is None
        else:
            host = not on_device and kwargs.get("device") is None
        if out is args[0] and is_host(out) != host and name in ("cpu", "to", "cuda"):
            out = out.view_as(out)  # a move that is a no-op on the CPU: a new tensor, as on GPUs
        mark(out, host)
        return out

    def check(self, func, name, args, kwargs, on_device) -> None:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in READS and first is not None and not is_host(first):
            self.flag(f"Tensor.{name} of a device tensor")
        elif name in SHAPE_FROM_DATA and on_device:
            self.flag(f"{name} of a device tensor (a shape from the device's data)")
        elif name == "repeat_interleave" and on_device and kwargs.get("output_size") is None:
            self.flag("repeat_interleave on the device without output_size")
        elif name in ("__getitem__", "__setitem__", "index_put_", "index") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool and not is_host(t)
            for t in tree_flatten(args[1:])[0]
        ):
            self.flag(f"{name} with a boolean device mask")
        elif name in ("tensor", "as_tensor", "asarray") and kwargs.get("device") is not None:
            self.flag(f"torch.{name}(..., device=...): a copy of Python data to the device")
        elif name in MOVES and first is not None and not kwargs.get("non_blocking", False):
            if name == "copy_":
                src = args[1]
                if not is_host(first) and isinstance(src, torch.Tensor) and is_host(src):
                    self.flag("copy_ of a host tensor into a device tensor, blocking")
            elif is_host(first) and (name == "cuda" or names_device(args, kwargs)):
                self.flag(f"Tensor.{name}(device) of a host tensor, blocking")


class CountedLoader:
    """The run's loader, telling the watch which step's work has begun."""

    def __init__(self, loader, run, watch: Watch):
        self.loader, self.run, self.watch = loader, run, watch

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        accum, k = self.run.feed.sampler.plan.accum_steps, 0
        self.watch.step = self.run.progress.step + 1
        batches = iter(self.loader)
        while True:
            if k % accum == 0:  # a step's first micro batch: its loading is its work
                self.watch.step = self.run.progress.step + 1
            try:
                batch = next(batches)
            except StopIteration:
                return
            k += 1
            yield batch


@contextlib.contextmanager
def engine_run(recipe: str, overrides: list[str], variant: str = ""):
    with tempfile.TemporaryDirectory(prefix="host-sync-") as root:
        fixed = ["log.wandb=off", "log.progress=off", f"run.root={root}", "run.name=sync"]
        cfg, rec = load_config(recipe, [*fixed, "device=cpu", *overrides], variant)
        run = setup(cfg, rec, D.DistEnv(), RUN_DEVICE)
        try:
            yield run
        finally:
            run.records.tracker.close()
            if run.held.lock_fd is not None:
                os.close(run.held.lock_fd)


def device_state(run) -> list[torch.Tensor]:
    """The tensors a run holds on its device as its steps begin."""
    modules = [run.net.model, run.net.bare] + (
        [run.net.ema.module] if run.net.ema is not None else []
    )
    held = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    held += tree_flatten(list(run.opt.optimizer.state.values()))[0] + [run.health.first_bad_step]
    data = run.feed.loader.data if isinstance(run.feed.loader, DeviceLoader) else None
    if data is not None:
        held += [data.images, data.labels, data.mean, data.std]
    return [t for t in held if isinstance(t, torch.Tensor)]


def watched_steps(run, steps: int) -> tuple[Watch, StepClock]:
    """`steps` optimizer steps of the engine's own loop (train_epoch) under the watch; the
    epoch is long enough that no epoch end (evaluation, checkpoint) falls among them."""
    assert run.feed.sampler.steps_per_epoch > steps
    run.progress.total_steps = run.cfg.train.stop_at_step = (
        steps  # stop_at_step: a checkpoint after
    )
    watch, clock = Watch(), StepClock()
    run.feed.loader = CountedLoader(run.feed.loader, run, watch)
    mark(device_state(run), host=False)
    checkpoint = T.checkpoint

    def checkpoint_unwatched(r):  # saving may read the device: not a step's cost
        watch.step = -1
        checkpoint(r)

    T.checkpoint = checkpoint_unwatched
    try:
        with watch:
            T.train_epoch(run, clock)
    finally:
        T.checkpoint = checkpoint
    return watch, clock


def assert_no_step_syncs(run, watch: Watch, steps: int) -> None:
    every = run.cfg.log.every_steps
    by_step: dict[int, list[Sync]] = {}
    for s in watch.syncs:
        by_step.setdefault(s.step, []).append(s)
    by_step.pop(-1, None)  # checkpoints
    assert set(by_step) <= set(range(1, steps + 1)), sorted(by_step)
    problems = []
    for step, found in sorted(by_step.items()):
        allowed = 1 if step % every == 0 else 0
        if len(found) > allowed:
            kind = "logging step" if allowed else "step"
            lines = [f"{kind} {step}: {len(found)} host syncs (allowed {allowed}):"]
            lines += [f"  {s.what}\n{s.stack}" for s in found]
            problems.append("\n".join(lines))
    assert not problems, "\n\n".join(problems)


DIGITS = ["train.batch_size=32", "log.every_steps=3", "model.width=8"]


@pytest.mark.parametrize(
    "extra",
    [
        [],  # nan_policy=stop, the default
        ["train.micro_batch_size=8"],  # 4 accumulation steps
        ["ema.decay=0.9", "ema.warmup_steps=2"],  # copies, then averages
        ["train.grad_clip=1.0", "train.label_smoothing=0.1"],
        ["mix.mixup_alpha=0.2", "mix.cutmix_alpha=1.0", "train.micro_batch_size=16"],
    ],
    ids=["default", "accumulation", "ema", "clip", "mix"],
)
def test_digits_steps_never_wait_for_the_device(extra):
    steps = 7
    with engine_run("digits", [*DIGITS, *extra]) as run:
        assert run.cfg.train.nan_policy == "stop"
        watch, clock = watched_steps(run, steps)
        assert run.progress.step == steps
        assert [r["step"] for r in clock.records] == [3, 6]
        assert_no_step_syncs(run, watch, steps)
        logging = [s for s in watch.syncs if s.step in (3, 6)]
        assert len(logging) == 2  # one read each: the window's figures come back together


def test_device_dataset_steps_never_wait_for_the_device(tmp_path):
    """cifar10 fast: the set on the device (DeviceImages), gathered and augmented there."""
    data = write_cifar_batches(tmp_path / "cifar10", n_train=96, n_test=8)
    overrides = [
        f"data.root={data}",
        "train.batch_size=8",
        "train.micro_batch_size=4",
        "train.compile=false",
        "model.widths=[8, 8, 8]",
        "log.every_steps=2",
        "ema.decay=0.5",
    ]
    steps = 5
    with engine_run("cifar10", overrides, variant="fast") as run:
        assert type(run.feed.loader).__name__ == "DeviceLoader"
        watch, _ = watched_steps(run, steps)
        assert run.progress.step == steps
        assert_no_step_syncs(run, watch, steps)


def test_the_watch_catches_a_read_of_the_loss_and_names_where():
    with engine_run("digits", DIGITS) as run:
        step = T.train_step

        def reading_step(r, micro):
            loss, norm = step(r, micro)
            loss.item()  # what the test must catch
            return loss, norm

        T.train_step = reading_step
        try:
            watch, _ = watched_steps(run, 2)
        finally:
            T.train_step = step
        with pytest.raises(AssertionError) as caught:
            assert_no_step_syncs(run, watch, 2)
        text = str(caught.value)
        assert "step 1: 1 host syncs" in text and "Tensor.item of a device tensor" in text
        assert "reading_step" in text  # the stack names the caller


def test_the_watch_tells_host_tensors_from_device_tensors():
    watch = Watch()
    weights = torch.ones(3)
    mark(weights, host=False)  # as the model's weights are
    with watch:
        host = torch.arange(3)  # no device: the host
        host.sum().item()  # a CPU read: no sync
        on_device = host.to(RUN_DEVICE, non_blocking=True)
        (on_device * weights).sum().item()  # sync 1
        torch.zeros(2, device=RUN_DEVICE).tolist()  # sync 2
        torch.tensor([1, 2], device=RUN_DEVICE)  # sync 3: Python data to the device
        host.to(RUN_DEVICE)  # sync 4: blocking copy
        bool(weights.sum() > 0)  # sync 5
        weights[weights > 0]  # sync 6: a boolean device mask
        weights.cpu().tolist()  # sync 7 (.cpu), then a host read
        f"{weights.sum()}"  # sync 8
        torch.nonzero(weights)  # sync 9
    assert len(watch.syncs) == 9, [s.what for s in watch.syncs]


def test_the_ema_update_matches_averaged_models_own():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from engine.config import EmaConfig
    from engine.ema import build_ema, update_ema

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    cfg = EmaConfig(decay=0.9, warmup_steps=2)
    ours = build_ema(model, cfg)
    theirs = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(8, 4))  # batch statistics and num_batches_tracked move
        update_ema(ours, model, step, cfg)
        if step <= cfg.warmup_steps:
            theirs.n_averaged.zero_()
        theirs.update_parameters(model)
    assert int(ours.n_averaged) == int(theirs.n_averaged)
    a, b = ours.module.state_dict(), theirs.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_non_finite_step_is_named_at_the_next_log(tmp_path):
    with engine_run("digits", [*DIGITS, "fault.nan_at_step=2"]) as run:
        with pytest.raises(T.RunError, match="non-finite gradients at step 2;"):
            watched_steps(run, 4)
        assert run.progress.step == 3  # the loop went on to the logging step, then stopped
