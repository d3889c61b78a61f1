"""The device mesh of hybrid sharding (dist.replicate) as a shape: (replicate, shard), so that
each shard group is a node's consecutive ranks. The runs on that mesh are
tests/engine/parallel/test_fsdp.py's (2 x 2, where a transposed shape looks the same)."""

from engine.config import DistConfig
from engine.parallel import mesh_shape


def test_the_mesh_is_replicate_groups_by_shard_ranks_never_transposed():
    assert mesh_shape(DistConfig(), 8) == (8,)
    assert mesh_shape(DistConfig(replicate=2), 8) == (2, 4)  # 2 nodes of 4: shard within
    assert mesh_shape(DistConfig(replicate=4), 8) == (4, 2)
    assert mesh_shape(DistConfig(replicate=3), 6) == (3, 2)
