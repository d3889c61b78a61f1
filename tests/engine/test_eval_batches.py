"""eval_batches: a rank's evaluation shard cut into batches. Over all ranks each held-out
sample is evaluated exactly once (no padding, no duplicates, the last partial batch kept),
in order, in batches no larger than eval.batch_size."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data.sampler import eval_batches, eval_shard


def rank_batches(n: int, batch_size: int, world_size: int) -> list[list[list[int]]]:
    """Each rank's batches as lists of dataset indices, as eval_loader builds them."""
    out = []
    for rank in range(world_size):
        batches = eval_batches(eval_shard(n, rank, world_size), batch_size)
        for batch in batches:
            assert all(seed == 0 and epoch == 0 for _, seed, epoch in batch), batch
        out.append([[index for index, _, _ in batch] for batch in batches])
    return out


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 300),
    batch_size=st.integers(1, 70),
    world_size=st.integers(1, 9),
)
def test_every_index_once_over_ranks_in_batches_of_at_most_the_batch_size(
    n, batch_size, world_size
):
    per_rank = rank_batches(n, batch_size, world_size)
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(n))  # each sample exactly once: none lost, none twice
    assert seen == list(range(n))  # contiguous shards, in order
    for rank, batches in enumerate(per_rank):
        shard = eval_shard(n, rank, world_size)
        assert all(1 <= len(batch) <= batch_size for batch in batches), (rank, batches)
        # full batches, then what is left: the partial last batch is kept, never dropped
        assert [len(b) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
        if batches:
            assert len(batches[-1]) == len(shard) - batch_size * (len(batches) - 1)
        assert len(batches) == -(-len(shard) // batch_size)  # ceil: no empty batch either


def test_a_shard_shorter_than_a_batch_is_one_partial_batch():
    assert eval_batches(range(3, 8), 16) == [[(i, 0, 0) for i in range(3, 8)]]
    assert eval_batches(range(0, 10), 4)[-1] == [(8, 0, 0), (9, 0, 0)]
    assert eval_batches(range(5, 5), 4) == []
