"""An ESTIMATE of the per-GPU memory of a variant under DDP, under FSDP on 8 GPUs and under FSDP
across 2 groups of 4 tensor-parallel GPUs (dist.tp=4), computed
from the config (nothing is allocated or measured): `python -m recipes.gpt.memory [variant]`
(default 1b; `config` for config.yaml) prints a Markdown table.

Assumed: bf16 autocast over fp32 master weights, AdamW. Per parameter: weights 4 B, gradients
4 B, AdamW's two moments 8 B; replicated under DDP, divided by the GPU count under FSDP.
Weights in bf16 while in use: under DDP autocast's copy of every weight (held for backward),
2 B/param; under FSDP the gathered bf16 copy of two units (the current and the prefetched
one), the largest unit being a block or the rest of the model. Activations per micro batch,
after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 2: 34 * s * b * h bytes per layer (s tokens, b sequences, h = d_model, 16-bit
activations), without its 5 * a * s^2 * b attention-score term, which SDPA's flash and
memory-efficient kernels never store. With activation checkpointing: each block's input,
2 * s * b * h bytes per layer, plus one block's full activations while it is recomputed. Left
out: the logits and loss (s * b * 256 values), the CUDA context, allocator fragmentation and
communication buffers.

Tensor parallelism (dist.tp=t, with sequence parallelism: recipes/gpt/parallel.py) splits every
matrix of a block and every activation of the residual stream over the t GPUs of its group,
and FSDP shards what each holds over the world / t groups: the states are divided by all the
GPUs (the LayerNorm weights, replicated within a group, are left out: 2 d_model per layer),
the gathered bf16 units and the activations per micro batch by t (Korthikanti et al.'s
34 * s * b * h / t with sequence parallelism), the micro batch being each data-parallel
group's."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from engine import catalog
from recipes.gpt.model import ModelConfig, build_model

GPUS = 8
TP = 4  # the tensor-parallel column: FSDP over GPUS / TP groups of TP GPUs
GIB = 2**30


@dataclass
class Setup:
    variant: str
    model: ModelConfig
    seq_len: int  # tokens per sequence (data.block_size)
    micro_batch: int  # sequences per GPU per forward


def load(variant: str, gpus: int = GPUS) -> Setup:
    """The variant's model, block size and micro batch, layered as a run's config is."""
    cfg, _ = catalog.load_config("gpt", [], "" if variant == "config" else variant)
    train = cfg.train
    micro = train.micro_batch_size or max(1, train.batch_size // gpus)
    return Setup(variant, cfg.model, cfg.data.block_size, micro)


def unit_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, the largest FSDP unit): a block, or what lies outside the blocks."""
    with torch.device("meta"):
        model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    per_block = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return total, max(*per_block, total - sum(per_block))


def state_bytes(params: int, largest_unit: int, shards: int, tp: int = 1) -> dict[str, float]:
    """Weights, gradients and AdamW moments (fp32), split over `shards` GPUs (1: DDP), and the
    bf16 weights in use (a tensor-parallel GPU gathers 1 / tp of each unit)."""
    in_use = 2 * params if shards == 1 else 2 * 2 * largest_unit / tp
    return {
        "weights": 4 * params / shards,
        "gradients": 4 * params / shards,
        "adamw": 8 * params / shards,
        "bf16": in_use,
    }


def activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, checkpointing: bool):
    one_layer = 34 * seq_len * micro_batch * cfg.d_model
    if not checkpointing:
        return cfg.n_layer * one_layer
    return cfg.n_layer * 2 * seq_len * micro_batch * cfg.d_model + one_layer


def estimate(setup: Setup, gpus: int = GPUS) -> dict[str, dict[str, float]]:
    """Per-GPU bytes by row, for "ddp", "fsdp" and "tp" (FSDP over gpus / TP groups)."""
    params, unit = unit_sizes(setup.model)
    acts = {
        ck: activation_bytes(setup.model, setup.seq_len, setup.micro_batch, ck) for ck in (0, 1)
    }
    out = {}
    for strategy, shards, tp in (("ddp", 1, 1), ("fsdp", gpus, 1), ("tp", gpus, TP)):
        rows = state_bytes(params, unit, shards, tp)
        states = sum(rows.values())
        rows |= {"acts": acts[0] / tp, "acts_ckpt": acts[1] / tp}
        rows |= {"total": states + rows["acts"], "total_ckpt": states + rows["acts_ckpt"]}
        out[strategy] = rows
    return out


LABELS = {
    "weights": "weights, fp32 (4 B/param)",
    "gradients": "gradients, fp32 (4 B/param)",
    "adamw": "AdamW moments, fp32 (8 B/param)",
    "bf16": "bf16 weights in use (DDP: all; FSDP: two gathered units; TP: 1/tp of them)",
    "acts": "activations, no checkpointing (34·s·b·h per layer)",
    "acts_ckpt": "activations, checkpointing (2·s·b·h per layer + one block's 34·s·b·h)",
    "total": "**total, no activation checkpointing**",
    "total_ckpt": "**total, activation checkpointing**",
}


def table(setup: Setup, gpus: int = GPUS) -> str:
    est = estimate(setup, gpus)
    params, _ = unit_sizes(setup.model)
    m = setup.model
    lines = [
        f"Estimated per-GPU memory of `{setup.variant}` ({params:,} parameters; "
        f"{m.n_layer} layers, d_model {m.d_model}; micro batch {setup.micro_batch} x "
        f"{setup.seq_len} tokens per GPU, per group of {TP} in the last column; bf16 autocast, fp32 weights, AdamW), computed by "
        f"`python -m recipes.gpt.memory {setup.variant}`: an estimate, not a measurement.",
        "",
        f"| GiB per GPU | DDP | FSDP, {gpus} GPUs | FSDP {gpus // TP} x TP {TP} (`dist.tp={TP}`) |",
        "|---|---:|---:|---:|",
    ]
    for key, label in LABELS.items():
        cells = " | ".join(f"{est[s][key] / GIB:.2f}" for s in ("ddp", "fsdp", "tp"))
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    variant = argv[0] if argv else "1b"
    known = ["config", *catalog.variants("gpt")]
    if variant not in known or len(argv) > 1:
        sys.exit(f"usage: python -m recipes.gpt.memory [{'|'.join(known)}] (default 1b)")
    print(table(load(variant)))


if __name__ == "__main__":
    main(sys.argv[1:])
