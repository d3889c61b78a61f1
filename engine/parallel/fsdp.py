"""FSDP2: parameters, gradients and optimizer states sharded over the processes, per block.

torchtitan's plan: each of the recipe's blocks is its own `fully_shard` unit (its parameters
are gathered just before it runs and freed after), then the root takes what is left (the
embeddings, the head). The recipe's model code stays single-device."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from engine.config import ConfigError, DistConfig


def device_mesh(
    device: torch.device, shape: tuple[int, ...], names: tuple[str, ...] = ()
) -> DeviceMesh:
    """(world,): one dimension over all processes (the data-parallel and sharding one).
    (replicate, shard): fully_shard on a 2-D mesh is HSDP, parameters placed (Replicate(),
    Shard(0)): reduce-scattered within a shard group, then all-reduced across the groups.
    (shard, tp) with names given: FSDP2 over the first, tensor parallelism over the second."""
    names = names or (("shard",) if len(shape) == 1 else ("replicate", "shard"))
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def check(dcfg: DistConfig, device: torch.device, amp: torch.dtype | None, ema: bool) -> None:
    """What FSDP cannot do here, said before anything is built."""
    if amp == torch.float16:
        raise ConfigError(
            "train.amp=fp16 with dist.strategy=fsdp: the loss scaler does not handle sharded "
            "gradients; use train.amp=bf16"
        )
    if dcfg.cpu_offload and device.type != "cuda":
        raise ConfigError(
            "dist.cpu_offload moves the shards from GPU to CPU memory; this run is on the CPU "
            "already: unset it"
        )
    if ema:
        raise ConfigError(
            "ema.decay with dist.strategy=fsdp: the averaged copy would be a full unsharded "
            "model on every process; set ema.decay=0 or use dist.strategy=ddp"
        )


def shard(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    dcfg: DistConfig,
    amp: torch.dtype | None,
) -> nn.Module:
    """fully_shard each block, then the root (in place; the model's names are unchanged)."""
    options = {
        "mesh": mesh,
        "reshard_after_forward": dcfg.fsdp_reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=amp,
            reduce_dtype=torch.float32 if amp is not None and dcfg.fsdp_reduce_fp32 else None,
        ),
    }
    if dcfg.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if not any(t.is_meta for t in model.parameters()):
        broadcast_from_first_rank(model)
    for block in blocks:
        fully_shard(block, **options)
    # The root's parameters are used last in backward: gathering them again there saves
    # nothing, so they stay gathered between forward and backward.
    fully_shard(model, **(options | {"reshard_after_forward": False}))
    return model


@torch.no_grad()
def broadcast_from_first_rank(model: nn.Module) -> None:
    """A model built with storage was initialised from each rank's own RNG stream: every rank
    takes rank 0's weights before sharding, as DDP does when it wraps (a model on the meta
    device is initialised after sharding, by name, the same on every rank)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor, src=0)
