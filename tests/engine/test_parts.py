"""A run's state in owned parts (engine.parts): every field declares whether a checkpoint
saves it, each part saves and restores itself, and a checkpoint is the sum of the parts, so
the checkpoint code names none of their fields. Bitwise resume itself is proven by the resume
tests (tests/faults, tests/distributed); these tests hold the structure that makes it hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import distributed as D
from engine.assemble import setup
from engine.catalog import load_config
from engine.parts import Part, saved, transient
from engine.run import Run
from engine.train import train_steps
from tests.helpers import QUIET, backend_flags, set_backend_flags


@pytest.fixture
def build(tmp_path):
    """setup() of a digits run in this process, closed and its global flags put back after."""
    flags, runs = backend_flags(), []

    def make(name: str, *overrides: str) -> Run:
        cfg, recipe = load_config(
            "digits", [*QUIET, f"run.root={tmp_path}", f"run.name={name}", *overrides]
        )
        run = setup(cfg, recipe, D.DistEnv(), torch.device("cpu"))
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.records.tracker.close()
        run.close()
    set_backend_flags(flags)


def test_no_central_object_carries_more_than_twelve_fields():
    from engine.parts import feed, health, network, optimisation, progress, records

    parts = [network.Network, optimisation.Optimisation, feed.Feed, progress.Progress]
    parts += [health.Health, records.Records]
    for cls in [Run, *parts]:
        assert len(dataclasses.fields(cls)) <= 12, cls.__name__


def test_every_field_of_every_part_declares_what_a_checkpoint_does_with_it(build):
    run = build("declared")
    for part in run.parts():
        for field in dataclasses.fields(part):
            assert field.metadata.get("kind") in ("saved", "recorded", "transient"), (
                f"{type(part).__name__}.{field.name}"
            )


def test_an_undeclared_field_fails_the_first_save_in_one_line():
    @dataclasses.dataclass
    class Careless(Part):
        counted: int = saved(default=0)
        forgotten: int = 0

    with pytest.raises(TypeError, match="forgotten is declared neither saved, recorded nor"):
        Careless().state_dict()


def test_a_new_saved_field_is_checkpointed_and_restored_without_touching_checkpoint_code():
    """What the owned parts buy: a field declared saved travels through state_dict and back;
    a checkpoint written before the field existed leaves it at its default."""

    @dataclasses.dataclass
    class Counter(Part):
        device_only: torch.Tensor | None = transient(default=None)
        seen: int = saved(default=0)
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = saved(default=None)

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    written = Counter(seen=7, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    opt.step()
    written.scheduler.step()
    state = written.state_dict()
    assert set(state) == {"seen", "scheduler"}  # transient: not written

    fresh = Counter(scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    fresh.load_state_dict(state)
    assert fresh.seen == 7
    assert fresh.scheduler.state_dict() == written.scheduler.state_dict()
    older = Counter()
    older.load_state_dict({})  # a checkpoint from before the field: the default stays
    assert older.seen == 0


def test_a_run_restored_from_its_state_dict_continues_where_the_other_stood(build):
    """Every saved piece of every part round-trips through Run.state_dict and
    Run.load_state_dict (what the checkpoint writes and a resume reads), and no two parts
    write the same key."""
    run = build("source", "train.max_steps=40", "ema.decay=0.9")
    train_steps(run, 3)
    run.health.skipped_steps, run.health.bad_samples = 2, 5
    run.records.last_eval, run.records.best = {"step": 3, "top1": 0.5}, [{"step": 3}]
    state = run.state_dict()
    expected = torch.rand(4)  # the source's next draw after the state was taken
    assert {"epoch", "step", "position", "rng", "world_size", "scheduler", "ema", "config"} <= set(
        state
    )

    other = build("target", "train.max_steps=40", "ema.decay=0.9")
    other.load_state_dict(state)
    for name in ("epoch", "step", "position"):
        assert getattr(other.progress, name) == getattr(run.progress, name)
    assert other.progress.step == 3 and other.progress.position > 0
    assert (other.health.skipped_steps, other.health.bad_samples) == (2, 5)
    assert (
        other.records.last_eval == run.records.last_eval and other.records.best == run.records.best
    )
    assert other.opt.scheduler.state_dict() == run.opt.scheduler.state_dict()
    ema, ema_other = run.net.ema.module.state_dict(), other.net.ema.module.state_dict()
    assert all(torch.equal(ema[k], ema_other[k]) for k in ema)
    assert int(other.net.ema.n_averaged) == int(run.net.ema.n_averaged) > 0
    torch.manual_seed(12345)  # whatever the stream was: loading puts the source's back
    other.progress.load_state_dict(state)
    assert torch.equal(torch.rand(4), expected)


def test_an_ema_run_refuses_a_state_without_an_ema(build):
    from engine.config import ConfigError

    plain = build("plain", "train.max_steps=4").state_dict()
    with pytest.raises(ConfigError, match="holds no EMA of the weights, but ema.decay is set"):
        build("averaged", "train.max_steps=4", "ema.decay=0.9").load_state_dict(plain)


def test_the_parts_hold_a_runs_state_and_not_what_the_process_holds():
    """A lock on the run directory, a checkpoint writer and a profiler are held by the
    process for the run (engine.run.Held), never fields of the parts a checkpoint sums."""
    from dataclasses import fields

    from engine.run import Held, Run

    part_types = [f.type for f in fields(Run) if f.name in ("net", "opt", "feed", "progress",
                                                             "health", "records")]  # fmt: skip
    assert len(part_types) == 6
    held = {f.name for f in fields(Held)}
    assert held == {"lock_fd", "writer", "profiling"}
    from engine import parts as P
    from engine.parts import feed, health, network, optimisation, progress, records

    classes = [feed.Feed, health.Health, network.Network, optimisation.Optimisation,
               progress.Progress, records.Records]  # fmt: skip
    assert all(issubclass(c, P.Part) for c in classes)
    assert not {f.name for c in classes for f in fields(c)} & held
