"""What a recipe trains for: the loss a step minimises and the metrics evaluation reports.

One loop serves every task. A task states its loss as a sum over the units it counts
(samples for classification, tokens for a language model) and how many units a target holds;
the engine divides by the global count, so the loss and its gradients are the same for any
world size and accumulation. Evaluation metrics are per-sample sums, reduced over ranks and
divided by the total count: exact, whatever the world size, and with each sample seen once."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE = -100  # targets at this value count for nothing (cross_entropy's ignore_index)


class Classification:
    """Cross entropy over class logits [B, C]; top-1 and top-5 accuracy."""

    metrics = ("loss", "top1", "top5")
    headline = "top1"
    higher_is_better = True
    unit = "samples"

    def count(self, target: torch.Tensor) -> torch.Tensor | None:
        """Units in the targets; None: one per sample (no reduction needed to know the total)."""
        return None

    def train_loss(
        self, output: torch.Tensor, target: torch.Tensor, label_smoothing: float
    ) -> torch.Tensor:
        """Summed over the batch. Soft targets (mixup/cutmix) are class probabilities."""
        return F.cross_entropy(output, target, label_smoothing=label_smoothing, reduction="sum")

    def eval_sums(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample sums, each of shape [B], and `count`, the units each sample holds."""
        k = min(5, output.shape[-1])
        hits = output.topk(k, dim=-1).indices == target[:, None]
        return {
            "loss": F.cross_entropy(output, target, reduction="none"),
            "top1": hits[:, 0].double(),
            "top5": hits.any(dim=-1).double(),
            "count": torch.ones(len(target), dtype=torch.float64, device=output.device),
        }

    def derived(self, means: dict[str, float]) -> dict[str, float]:
        return {}

    def describe(self, result: dict) -> str:
        return (
            f"top1 {100 * result['top1']:.2f}% top5 {100 * result['top5']:.2f}% "
            f"loss {result['loss']:.4f}"
        )


class NextToken:
    """Next-token prediction: logits [B, T, V] against targets [B, T]; the loss is per token,
    targets equal to IGNORE count for nothing. Reports perplexity and bits per token."""

    metrics = ("loss",)
    headline = "loss"
    higher_is_better = False
    unit = "tokens"

    def count(self, target: torch.Tensor) -> torch.Tensor | None:
        return (target != IGNORE).sum()

    def train_loss(
        self, output: torch.Tensor, target: torch.Tensor, label_smoothing: float
    ) -> torch.Tensor:
        return F.cross_entropy(
            output.flatten(0, -2).float(),
            target.flatten(),
            ignore_index=IGNORE,
            label_smoothing=label_smoothing,
            reduction="sum",
        )

    def eval_sums(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        per_token = F.cross_entropy(
            output.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE, reduction="none"
        ).view(target.shape)
        return {
            "loss": per_token.double().sum(dim=-1),
            "count": (target != IGNORE).sum(dim=-1).double(),
        }

    def derived(self, means: dict[str, float]) -> dict[str, float]:
        loss = means["loss"]
        return {"perplexity": math.exp(min(loss, 700.0)), "bits_per_token": loss / math.log(2)}

    def describe(self, result: dict) -> str:
        return (
            f"loss {result['loss']:.4f} perplexity {result['perplexity']:.3f} "
            f"({result['bits_per_token']:.3f} bits per token)"
        )
