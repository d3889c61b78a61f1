"""Activation checkpointing per block: each block's activations are recomputed in the
backward pass instead of kept from the forward.

Each block's own forward is replaced by torch.utils.checkpoint's non-reentrant checkpoint of
it: no wrapper module, so every parameter keeps its name (checkpoints, exports and
`init_weights` see the same names with it on or off), and FSDP's hooks on the block still run
around it (its pre-backward hook gathers the parameters before the recomputation). dynamo
traces it as one higher-order op, so the blocks stay inside the compiled graph; the
composable `torch.distributed._composable.checkpoint` (hooks) did not: its recomputation
under torch.compile fails with "Recomputed values ... have different metadata". The RNG state
is saved and replayed, so dropout draws the same masks."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
