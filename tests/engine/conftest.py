"""Shared by the engine's in-process tests."""

import pytest
import torch


def backend_flags() -> tuple:
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
    )


def set_backend_flags(saved: tuple) -> None:
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:3]
    torch.backends.cudnn.deterministic = saved[3]
    torch.use_deterministic_algorithms(saved[4])


@pytest.fixture
def restore_backend_flags():
    """train() and setup() set global flags (TF32, cuDNN, deterministic algorithms): restored
    afterwards, for the tests that run next in this process."""
    saved = backend_flags()
    yield
    set_backend_flags(saved)


@pytest.fixture(scope="session")
def train_here():
    """Trains as `python -m engine.train RECIPE QUIET run.root=ROOT run.name=NAME OVERRIDES`
    would (engine.train.train, one process, one thread as tests.helpers.engine_env gives the
    engine's processes), but in this process: for tests whose subject is what a run trains,
    not the process (its start-up, exit status or signals). The global flags and the thread
    count it changes are put back after each run; rank 0's lines are in the run's train.log
    (and on this process's stderr)."""
    from engine.catalog import load_config
    from engine.train import train
    from tests.helpers import QUIET

    def run(root, name: str, *overrides: str, recipe: str = "digits") -> None:
        args = [*QUIET, f"run.root={root}", f"run.name={name}", *overrides]
        cfg, recipe_ = load_config(recipe, args)
        threads = torch.get_num_threads()
        saved = backend_flags()
        torch.set_num_threads(1)
        try:
            assert train(cfg, recipe_) == 0
        finally:
            torch.set_num_threads(threads)
            set_backend_flags(saved)

    return run
