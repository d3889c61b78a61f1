"""Regression by mean squared error, judged by its root (lower is better)."""

import math

import torch
import torch.nn.functional as F


class Regression:
    """The model's output and the target have the same shape, [batch, 1] here: a target of
    [batch] against an output of [batch, 1] would broadcast to [batch, batch]."""

    name, unit = "regression", "samples"
    metrics, headline, higher_is_better = ("loss",), "rmse", False
    supports = frozenset()  # no classes: mix.* and train.label_smoothing are refused

    def for_model(self, model_config):
        return self

    def count(self, target):
        return None  # one unit per sample

    def train_loss(self, output, target, label_smoothing):
        return self._squared_error(output, target).sum()

    def eval_sums(self, output, target):
        error = self._squared_error(output, target).double()
        return {"loss": error, "count": torch.ones_like(error)}

    def derived(self, means):
        return {"rmse": math.sqrt(means["loss"])}

    def describe(self, result):
        return f"loss {result['loss']:.4f} rmse {result['rmse']:.4f}"

    @staticmethod
    def _squared_error(output, target):
        """Each sample's squared error, [batch] (the mean over its outputs)."""
        if output.shape != target.shape:
            raise ValueError(f"output {tuple(output.shape)} and target {tuple(target.shape)}")
        return F.mse_loss(output, target, reduction="none").flatten(1).mean(1)
