"""CIFAR-10 through the real reader of the official python batches: the fast variant's
on-device run is deterministic, resumes bitwise mid-epoch, and 1 process with 2 accumulation
steps (every fast run here) trains like 2 processes with 1; the default variant trains
through workers."""

import sys

import pytest

from tests.datagen_cifar import write_cifar_batches
from tests.helpers import final_weights, max_difference, records, run_dir, run_engine, same_weights

pytestmark = pytest.mark.slow
FAST = [
    "train.batch_size=16",
    "train.micro_batch_size=8",  # 2 accumulation steps on 1 process, 1 on 2
    "train.max_steps=9",  # 80 training images: 5 steps an epoch, so the stop is mid-epoch
    "train.compile=false",
    "model.widths=[8, 16, 16]",
    "sched.warmup_steps=2",
    "ckpt.every_steps=3",
    "log.every_steps=1",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_cifar_batches(tmp_path_factory.mktemp("data") / "cifar10", n_train=80, n_test=30)


def fast(root, name, data, *overrides, prefix=None):
    args = [f"data.root={data}", *FAST, *overrides]
    return run_engine(root, name, *args, recipe="cifar10", variant="fast", prefix=prefix)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """One process's fast run: the run the others must equal."""
    root = tmp_path_factory.mktemp("reference")
    fast(root, "a", data)
    return root


def test_fast_variant_is_deterministic_and_resumes_bitwise_mid_epoch(
    tmp_path, data, reference, train_here
):
    """The reference and the resume run in processes of their own, the rest in the test's:
    the same weights across a process boundary each time."""

    def fast_here(name, *overrides):
        args = [f"data.root={data}", *FAST, *overrides]
        train_here(tmp_path, name, *args, recipe="cifar10", variant="fast")

    fast_here("b")
    reference = final_weights(reference, "a", "cifar10")
    assert same_weights(final_weights(tmp_path, "b", "cifar10"), reference)
    fast_here("other-seed", "seed=1")
    assert not same_weights(final_weights(tmp_path, "other-seed", "cifar10"), reference)

    fast_here("resumed", "train.stop_at_step=7")
    assert (
        "stopped at step 7" in (run_dir(tmp_path, "resumed", "cifar10") / "train.log").read_text()
    )
    fast(tmp_path, "resumed", data)
    assert same_weights(final_weights(tmp_path, "resumed", "cifar10"), reference)
    assert records(tmp_path, "resumed", "eval", "cifar10")[-1]["count"] == 30


def test_fast_variant_world_size_invariant(tmp_path, data, reference):
    spawn = [sys.executable, "-m", "engine.train"]
    fast(tmp_path, "two", data, prefix=[*spawn, "--spawn", "2"])
    one, two = final_weights(reference, "a", "cifar10"), final_weights(tmp_path, "two", "cifar10")
    params = [k for k in one if "running" not in k and "num_batches" not in k]
    assert max_difference({k: one[k] for k in params}, {k: two[k] for k in params}) < 1e-4
    one_losses = [r["loss"] for r in records(reference, "a", "train", "cifar10")]
    two_losses = [r["loss"] for r in records(tmp_path, "two", "train", "cifar10")]
    assert one_losses == pytest.approx(two_losses, abs=1e-4)


def test_default_variant_trains_resnet18_through_workers(tmp_path, data):
    run_engine(
        tmp_path,
        "resnet",
        f"data.root={data}",
        "train.batch_size=16",
        "train.max_steps=3",
        "loader.num_workers=2",
        recipe="cifar10",
    )
    assert records(tmp_path, "resnet", "eval", "cifar10")[-1]["count"] == 30


@pytest.mark.parametrize("variant", ["", "fast"])
def test_missing_data_is_one_line_saying_where_and_how(tmp_path, variant):
    out = run_engine(
        tmp_path,
        "none",
        f"data.root={tmp_path / 'nothing'}",
        recipe="cifar10",
        variant=variant,
        check=False,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert str(tmp_path / "nothing" / "cifar-10-batches-py") in lines[0]
    assert "data.download=true" in lines[0]
