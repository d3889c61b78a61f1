"""The GPT's tensor-parallel plan (Megatron-LM's split, with sequence parallelism), kept beside
the model as torchtitan keeps one beside each of its models; the engine owns the mesh.

Inside a block, the query, key, value and the MLP's first projection are split by columns
(each process holds n_head / tp heads and 4 d_model / tp hidden units) and the two output
projections by rows, so a block costs one all-gather before attention and the MLP and one
reduce-scatter after each. Between them the residual stream and the LayerNorms are split
along the sequence (SequenceParallel): no activation is held whole on every process. The
embeddings are split by rows (vocabulary, positions) and the head by columns, its logits
gathered whole so the loss is the single-process one."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.config import ConfigError

# A recipe never imports torch.distributed (ruff's TID251), except a plan's vocabulary here:
# DTensor's layouts and torch's parallel styles say how each matrix splits; no process group
# or collective. They cost seconds of start-up: only a run with dist.tp > 1 imports them.


def check(model: Any, data: Any, tp: int) -> None:
    """What dist.tp needs of the model and its sequences, said in one line before anything is
    built: the heads, positions and byte values each split into tp equal parts, and each
    sequence too (the residual stream is cut along it)."""
    parts = {
        "model.n_head": model.n_head,
        "model.context": model.context,
        "model.vocab_size": model.vocab_size,
        "data.block_size": data.block_size,
    }
    for name, value in parts.items():
        if value % tp:
            fits = [d for d in range(1, value + 1) if value % d == 0 and d <= 16]
            raise ConfigError(
                f"dist.tp={tp} does not divide {name}={value}: tensor parallelism splits it "
                f"into tp equal parts; use dist.tp in {', '.join(map(str, fits))}"
            )


def block_plan() -> dict[str, Any]:
    """One block: LayerNorms on sequence shards; attention and MLP gather the sequence, run
    their heads / hidden units, and reduce-scatter back to sequence shards."""
    from torch.distributed.tensor import Replicate, Shard  # start-up time  # noqa: TID251
    from torch.distributed.tensor.parallel import (  # start-up time  # noqa: TID251
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sequence = Shard(1)  # the residual stream is [batch, sequence, width]
    gather = PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),))
    return {
        "ln_1": SequenceParallel(),
        "attn": gather,
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=sequence),
        "ln_2": SequenceParallel(),
        "mlp": gather,
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=sequence),
    }


def parallelize(model: nn.Module, mesh) -> None:
    """Apply the plan in place on the tensor-parallel mesh (1-D); parameter names unchanged."""
    from torch.distributed.tensor import Replicate, Shard  # start-up time  # noqa: TID251
    from torch.distributed.tensor.parallel import (  # start-up time  # noqa: TID251
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sequence = Shard(1)
    parallelize_module(
        model,
        mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence),
            # positions [T] -> [T, D]: its sequence is dim 0, added to [B, T, D] by broadcast
            "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()),
        },
    )
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan())
