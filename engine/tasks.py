"""What a recipe trains for: the loss a step minimises and the metrics evaluation reports.

One loop serves every task. A task states its loss as a sum over the units it counts
(samples for classification, tokens for a language model) and how many units a target holds;
the engine divides by the global count, so the loss and its gradients are the same for any
world size and accumulation. Evaluation metrics are per-sample sums, reduced over ranks and
divided by the total count: exact, whatever the world size, and with each sample seen once."""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from engine import recipe as contract
from engine.config import ConfigError

IGNORE = -100  # targets at this value count for nothing (cross_entropy's ignore_index)


@runtime_checkable
class Task(Protocol):
    """What the engine needs from a recipe's task. Every task in engine.tasks satisfies it
    (tests/engine/test_tasks.py checks each recipe's)."""

    metrics: tuple[str, ...]  # evaluation's per-sample sums, divided by the summed count
    headline: str  # the metric a run is judged by (one of metrics or derived's keys)
    higher_is_better: bool  # the headline's direction, recorded for reports and comparisons
    unit: str  # what count() counts ("samples", "tokens"): logged as <unit>_per_s

    def for_model(self, model_config: Any) -> Task:
        """The task for this run's model config (e.g. its class count); called once at set-up."""
        ...

    def count(self, target: torch.Tensor) -> torch.Tensor | None:
        """Units in the targets; None: one per sample (no reduction needed to know the total)."""
        ...

    def train_loss(
        self, output: torch.Tensor, target: torch.Tensor, label_smoothing: float
    ) -> torch.Tensor:
        """The loss summed over the units; the engine divides by the global count."""
        ...

    def eval_sums(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample sums of each metric, each of shape [B], and `count`, units per sample."""
        ...

    def derived(self, means: dict[str, float]) -> dict[str, float]:
        """Metrics computed from the means (perplexity from the loss)."""
        ...

    def describe(self, result: dict) -> str:
        """An evaluation result in one line for the log."""
        ...

    # Optional, read by check_supported (a task without them supports none of the features):
    # name: str  (what messages call the task, e.g. "regression"; else its class name)
    # supports: frozenset[str]  (of FEATURES: what the task's loss and targets can take)


# What a task may support, beyond training on its loss: MixUp/CutMix (soft targets over
# classes: mix.*) and label smoothing (train.label_smoothing).
FEATURES = ("mix", "label_smoothing")


def task_of(recipe: Any) -> Task:
    """The recipe's task (Recipe.task); classification where it declares none."""
    return recipe.task if recipe.task is not None else Classification()


def task_name(task: Any) -> str:
    return getattr(task, "name", "") or type(task).__name__.lower()


def check_supported(task: Any, train: Any, mix: Any) -> None:
    """Refuse, in one line naming the task and the key, a train or mix setting the task's
    loss cannot honour (it would otherwise be ignored, or fail with another task's words)."""
    supports = getattr(task, "supports", frozenset())
    name = task_name(task)
    if train.label_smoothing > 0 and "label_smoothing" not in supports:
        raise ConfigError(
            f"train.label_smoothing={train.label_smoothing:g}: the {name} task has no classes "
            "to smooth; leave it 0"
        )
    if "mix" not in supports:
        for key in ("mixup_alpha", "cutmix_alpha"):
            value = getattr(mix, key)
            if value > 0:
                raise ConfigError(
                    f"mix.{key}={value:g}: the {name} task has no class labels to mix "
                    "(MixUp and CutMix mix classification targets); leave it 0"
                )


class Classification:
    """Cross entropy over class logits [B, C]; top-1 accuracy, and top-5 where there are more
    than 5 classes (with 5 or fewer it is always 100%)."""

    name = "classification"
    headline = "top1"
    higher_is_better = True
    unit = "samples"
    supports = frozenset({"mix", "label_smoothing"})
    TOP_K = 5

    def __init__(self, num_classes: int = 0):
        self.num_classes = num_classes  # 0: not known (top-5 is reported)

    @property
    def metrics(self) -> tuple[str, ...]:
        top_k = not self.num_classes or self.num_classes > self.TOP_K
        return ("loss", "top1", "top5") if top_k else ("loss", "top1")

    def for_model(self, model_config: Any) -> Classification:
        """model.num_classes, an engine-read field, after the data has resolved a 0."""
        return Classification(contract.num_classes(model_config) or self.num_classes)

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
        k = min(self.TOP_K, output.shape[-1])
        hits = output.topk(k, dim=-1).indices == target[:, None]
        sums = {
            "loss": F.cross_entropy(output, target, reduction="none"),
            "top1": hits[:, 0].double(),
            "top5": hits.any(dim=-1).double(),
            "count": torch.ones(len(target), dtype=torch.float64, device=output.device),
        }
        return {name: sums[name] for name in (*self.metrics, "count")}

    def derived(self, means: dict[str, float]) -> dict[str, float]:
        return {}

    def describe(self, result: dict) -> str:
        top5 = f"top5 {100 * result['top5']:.2f}% " if "top5" in result else ""
        return f"top1 {100 * result['top1']:.2f}% {top5}loss {result['loss']:.4f}"


class NextToken:
    """Next-token prediction: logits [B, T, V] against targets [B, T]; the loss is per token,
    targets equal to IGNORE count for nothing. Reports perplexity and bits per token."""

    name = "next-token"
    metrics = ("loss",)
    headline = "loss"
    higher_is_better = False
    unit = "tokens"
    supports = frozenset({"label_smoothing"})  # over the vocabulary; no sample mixing

    def for_model(self, model_config: Any) -> NextToken:
        return self

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
