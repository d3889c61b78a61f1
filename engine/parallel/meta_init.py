"""Models built on the meta device and initialised after sharding.

A recipe that declares `init_weights` gets its model built without memory (the meta device),
sharded (or not), and only then given storage, each tensor filled from a generator seeded by
(seed, name). The weights are a function of the seed alone: the same in one process, under
DDP or under FSDP on any number of processes; and a model larger than one process's memory
starts, since each process holds its shard plus one full tensor at a time."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from engine.seeding import derive_seed


def build(recipe, model_cfg) -> nn.Module:
    """The recipe's model: on the meta device when the recipe initialises it by name."""
    if recipe.init_weights is None:
        return recipe.build_model(model_cfg)
    with torch.device("meta"):
        return recipe.build_model(model_cfg)


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def generator(seed: int, name: str) -> torch.Generator:
    # crc32: a hash of the name that is the same in every process (hash() is salted)
    return torch.Generator().manual_seed(derive_seed(seed, zlib.crc32(name.encode())))


@torch.no_grad()
def initialise(model: nn.Module, recipe, model_cfg, seed: int, device: torch.device) -> None:
    """Give the meta model storage on `device` and fill every parameter and buffer: the full
    tensor is drawn on the CPU and each process keeps its own shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # start-up time: seconds

    model.to_empty(device=device)
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        full = torch.empty(tensor.shape, dtype=tensor.dtype)
        recipe.init_weights(model_cfg, name, full, generator(seed, name))
        if isinstance(tensor, DTensor):
            # src_data_rank=None: every rank drew the same full tensor; each keeps its part
            # without communication.
            local = distribute_tensor(
                full, tensor.device_mesh, tensor.placements, src_data_rank=None
            )
            tensor.to_local().copy_(local.to_local())
        else:
            tensor.copy_(full)
