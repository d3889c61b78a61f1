"""A byte-level decoder-only transformer (GPT-2's architecture, nanoGPT-sized code).

Token and learned position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention
through `F.scaled_dot_product_attention`, a 4x GELU MLP), a final LayerNorm and a linear head
onto the 256 byte values. The head is not tied to the token embedding: tied weights that
live in different FSDP units would have to be gathered together. The model holds no buffers
(the causal mask is SDPA's `is_causal`), so every tensor is a parameter that `init_weights`
fills, and the model can be built on the meta device and initialised shard by shard."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError, bounded


@dataclass
class ModelConfig:
    vocab_size: int = bounded(256, ge=1)  # bytes
    context: int = bounded(64, ge=1)  # longest sequence: rows of the position embedding
    n_layer: int = bounded(3, ge=1)
    n_head: int = bounded(4, ge=1)
    d_model: int = bounded(96, ge=1)  # a multiple of n_head
    dropout: float = bounded(0.0, ge=0, lt=1)  # attention, residual and embedding; training only
    bias: bool = False  # biases in Linear and LayerNorm (GPT-2: true; nanoGPT: optional)


class SelfAttention(nn.Module):
    """Causal self-attention. Query, key and value are three projections, not one fused
    [3D, D] matrix: tensor parallelism splits each by output rows (recipes/gpt/parallel.py),
    and a contiguous split of a fused matrix would hand a rank all the queries and none of
    the values. The forward counts heads from its input (-1), so a rank that holds
    n_head / tp heads' columns runs the same code."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.dropout = cfg.d_model // cfg.n_head, cfg.dropout
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)  # a residual output
        self.drop = nn.Dropout(cfg.dropout)

    def heads(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """[B, T, D] -> [B, H, T, D/H] (H: the heads this process holds)."""
        b, t = x.shape[:2]
        return linear(x).view(b, t, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = (self.heads(x, linear) for linear in (self.q, self.k, self.v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)  # a residual output
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)): the pre-LayerNorm residual block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.context = cfg.context
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Tokens [B, T] (int64) -> logits [B, T, vocab_size]; position t sees tokens <= t."""
        t = idx.shape[1]
        if t > self.context:
            raise ConfigError(
                f"sequences of {t} tokens (data.block_size) exceed model.context={self.context}: "
                f"set data.block_size <= model.context or model.context >= {t}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(cfg: ModelConfig) -> GPT:
    if cfg.d_model % cfg.n_head:
        raise ConfigError(
            f"model.d_model={cfg.d_model} is not a multiple of model.n_head={cfg.n_head}: "
            "each head takes d_model / n_head channels"
        )
    return GPT(cfg)


def blocks(model: GPT) -> list[nn.Module]:
    """The units FSDP shards and activation checkpointing recomputes: the transformer blocks."""
    return list(model.blocks)


# GPT-2's initialisation, by role: a parameter name with its block index replaced by "*".
# "normal": N(0, 0.02); "residual": N(0, 0.02 / sqrt(2 * n_layer)), for the projections that
# add into the residual stream (two per block), so its variance does not grow with depth.
STD = 0.02
INIT = {
    "tok_emb.weight": "normal",
    "pos_emb.weight": "normal",
    "blocks.*.ln_1.weight": "ones",
    "blocks.*.ln_1.bias": "zeros",
    "blocks.*.attn.q.weight": "normal",
    "blocks.*.attn.q.bias": "zeros",
    "blocks.*.attn.k.weight": "normal",
    "blocks.*.attn.k.bias": "zeros",
    "blocks.*.attn.v.weight": "normal",
    "blocks.*.attn.v.bias": "zeros",
    "blocks.*.attn.proj.weight": "residual",
    "blocks.*.attn.proj.bias": "zeros",
    "blocks.*.ln_2.weight": "ones",
    "blocks.*.ln_2.bias": "zeros",
    "blocks.*.mlp.fc.weight": "normal",
    "blocks.*.mlp.fc.bias": "zeros",
    "blocks.*.mlp.proj.weight": "residual",
    "blocks.*.mlp.proj.bias": "zeros",
    "ln_f.weight": "ones",
    "ln_f.bias": "zeros",
    "head.weight": "normal",
    "head.bias": "zeros",
}


def role(name: str) -> str:
    """`blocks.3.attn.qkv.weight` -> `blocks.*.attn.qkv.weight`."""
    return re.sub(r"^blocks\.\d+\.", "blocks.*.", name)


@torch.no_grad()
def init_weights(
    cfg: ModelConfig, name: str, tensor: torch.Tensor, generator: torch.Generator
) -> None:
    """Fill the parameter `name` (as in `model.named_parameters()`) in place, drawing from
    `generator`. A name without a rule raises, so no new parameter goes uninitialised."""
    kind = INIT.get(role(name))
    if kind is None:
        raise KeyError(f"init_weights: no rule for parameter {name!r}; add its role to INIT")
    if kind == "ones":
        tensor.fill_(1.0)
    elif kind == "zeros":
        tensor.zero_()
    else:
        std = STD / math.sqrt(2 * cfg.n_layer) if kind == "residual" else STD
        tensor.normal_(0.0, std, generator=generator)


def parameter_count(cfg: ModelConfig) -> int:
    """Exact, from the model built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, as PaLM (appendix B) and nanoGPT count
    them: 6 per weight of every matrix multiply (the parameters less the two embeddings,
    which are lookups), plus attention's two [T, T] products, 12 * n_layer * d_model * T
    (the full square, not halved for the causal mask)."""
    embeddings = (cfg.vocab_size + cfg.context) * cfg.d_model
    return 6 * (parameter_count(cfg) - embeddings) + 12 * cfg.n_layer * cfg.d_model * seq_len
