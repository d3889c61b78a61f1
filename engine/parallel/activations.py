"""Activation checkpointing per block: each block's activations are recomputed in the
backward pass instead of kept from the forward.

The composable `checkpoint` (hooks, not a wrapper module) keeps every parameter's name, so
checkpoints, exports and `init_weights` see the same names with it on or off; it composes
with `fully_shard`. The RNG state is saved and replayed, so dropout draws the same masks."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    for block in blocks:
        checkpoint(block)
