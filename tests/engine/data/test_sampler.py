import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import ConfigError
from engine.data.sampler import (
    GlobalBatchSampler,
    check_elastic,
    epoch_permutation,
    eval_shard,
    plan_batches,
)
from tests.helpers import REPO


def global_batches(n, batch, world, micro, seed, epoch, start=0):
    """What all ranks together visit, grouped by optimizer step."""
    plan = plan_batches(batch, micro, world)
    per_rank = []
    for rank in range(world):
        s = GlobalBatchSampler(n, plan, rank, seed)
        s.set_epoch(epoch, start)
        micro_batches = [[key[0] for key in mb] for mb in s]
        per_rank.append(
            [
                sum(micro_batches[k : k + plan.accum_steps], [])
                for k in range(0, len(micro_batches), plan.accum_steps)
            ]
        )
    return [sorted(sum(step, [])) for step in zip(*per_rank, strict=True)]


def test_order_is_a_function_of_seed_and_epoch_only():
    assert torch.equal(epoch_permutation(3, 1, 100), epoch_permutation(3, 1, 100))
    assert not torch.equal(epoch_permutation(3, 1, 100), epoch_permutation(3, 2, 100))
    assert not torch.equal(epoch_permutation(3, 1, 100), epoch_permutation(4, 1, 100))


@pytest.mark.parametrize("world, micro", [(1, 16), (2, 16), (4, 8), (1, 4), (8, 2)])
def test_same_samples_per_optimizer_step_for_any_world_size(world, micro):
    reference = global_batches(100, 32, 1, 32, seed=7, epoch=2)
    assert global_batches(100, 32, world, micro, seed=7, epoch=2) == reference
    assert len(reference) == 3  # 100 // 32; the incomplete batch is dropped


def test_resume_position_skips_exactly_the_consumed_steps():
    full = global_batches(100, 16, 2, 8, seed=1, epoch=0)
    assert global_batches(100, 16, 4, 2, seed=1, epoch=0, start=48) == full[3:]


def test_sample_seeds_depend_on_seed_epoch_and_index_not_rank():
    plan1, plan2 = plan_batches(8, None, 1), plan_batches(8, None, 2)
    one = {i: s for mb in GlobalBatchSampler(8, plan1, 0, 5) for i, s, _ in mb}
    two = {i: s for r in range(2) for mb in GlobalBatchSampler(8, plan2, r, 5) for i, s, _ in mb}
    assert one == two and len(set(one.values())) == 8


def test_sample_seeds_change_with_the_epoch_and_the_run_seed():
    """Another epoch or another seed draws other augmentations for the same sample."""

    def seeds(seed: int, epoch: int) -> dict[int, int]:
        sampler = GlobalBatchSampler(8, plan_batches(8, None, 1), 0, seed)
        sampler.set_epoch(epoch)
        return {i: s for mb in sampler for i, s, _ in mb}

    first = seeds(5, 0)
    for other in (seeds(5, 1), seeds(6, 0)):
        assert other.keys() == first.keys()
        assert all(other[i] != first[i] for i in first)
    assert seeds(5, 1) == seeds(5, 1)


@pytest.mark.parametrize(
    "batch, micro, world, message",
    [
        (30, None, 4, "does not divide over 4"),
        (32, 5, 2, "not a multiple of train.micro_batch_size=5"),
    ],
)
def test_batch_plan_errors(batch, micro, world, message):
    with pytest.raises(ConfigError, match=message):
        plan_batches(batch, micro, world)


def test_accumulation_steps():
    assert plan_batches(256, 16, 4).accum_steps == 4
    assert plan_batches(64, None, 2).accum_steps == 1


@pytest.mark.parametrize("n", [0, 1, 7, 359, 360])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_eval_shards_cover_each_sample_once(n, world):
    seen = [i for r in range(world) for i in eval_shard(n, r, world)]
    assert seen == list(range(n))


# ---------------------------------------------------------------- elastic world sizes


def world_size_ok(batch: int, micro: int | None, world: int) -> bool:
    try:
        plan_batches(batch, micro, world)
    except ConfigError:
        return False
    return True


def suggested(message: str, key: str) -> list[int]:
    found = re.findall(rf"train\.{key}=(\d+)(?: or (\d+))?", message)
    return [int(v) for pair in found for v in pair if v]


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 600),
    micro=st.one_of(st.none(), st.integers(1, 64)),
    fewest=st.integers(1, 4),
    more=st.integers(1, 3),
    per_node=st.integers(1, 4),
)
def test_an_elastic_range_passes_exactly_when_every_world_size_keeps_the_batch(
    batch, micro, fewest, more, per_node
):
    sizes = [n * per_node for n in range(fewest, fewest + more + 1)]
    try:
        check_elastic(batch, micro, sizes)
    except ConfigError as err:
        message = str(err)
    else:
        assert micro is not None and all(world_size_ok(batch, micro, w) for w in sizes)
        return
    assert "\n" not in message
    if micro is not None and all(world_size_ok(batch, micro, w) for w in sizes):
        raise AssertionError(f"refused a batch every world size keeps: {message}")
    advice = message.split(";")[-1]
    batches, micros = suggested(advice, "batch_size"), suggested(advice, "micro_batch_size")
    assert batches or micros, message
    # Each suggestion, applied alone to the rest of the request, is accepted: never advice
    # that the next check refuses for the micro batch the request already gave.
    for fixed in batches:
        assert all(fixed % w == 0 for w in sizes), message
        if micro is not None:
            check_elastic(fixed, micro, sizes)
    for fixed in micros:
        assert all(world_size_ok(batch, fixed, w) for w in sizes), message
        assert micro is None or fixed <= micro


def test_the_documented_elastic_example_passes_its_check():
    # docs/distributed.md: `make train ... NODES=2:4 GPUS=8 ARGS="..."`, every world size
    text = (REPO / "docs" / "distributed.md").read_text()
    (line,) = [x for x in text.splitlines() if "NODES=2:4" in x and "GPUS=8" in x]
    batch = int(re.search(r"train\.batch_size=(\d+)", line)[1])
    micro = int(re.search(r"train\.micro_batch_size=(\d+)", line)[1])
    check_elastic(batch, micro, [16, 24, 32])


def test_an_elastic_range_without_a_micro_batch_names_one():
    with pytest.raises(ConfigError, match=r"set train\.micro_batch_size=8 \(or a divisor of it\)"):
        check_elastic(96, None, [2, 4, 6])
    check_elastic(96, 8, [2, 4, 6])  # 6, 3 and 2 accumulation steps of 8
    with pytest.raises(ConfigError, match=r"use train\.micro_batch_size=8 \(a divisor of 8\)"):
        check_elastic(96, 16, [2, 4, 6])  # 24 per process on 4 is no multiple of 16
