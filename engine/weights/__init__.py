"""Weights in one home. Starting from weights trained elsewhere (`model.init_from=PATH`,
`model.weights=NAME`): where they are (sources), reading any format (files), matching them to
the model by name and loading them (match); `make export` and `--eval` read through files too.

A weights file is read whatever wrote it: this project's checkpoints (a file, a sharded folder,
or a run folder: its newest valid one) and exports (.pt, .safetensors), torchvision's published
state dicts, timm's files (.safetensors, pytorch_model.bin, and training checkpoints holding
state_dict / state_dict_ema / model / model_ema). Every load is weights-only and wrapper
prefixes (module., _orig_mod.) are dropped.

The file's tensors are matched to the model by name and shape. A tensor whose shape differs
only in the classifier's output rows (a head for another number of classes), or whose name
matches model.init_skip, keeps the weights the run's seed gave it; a tensor the model lacks is
left unused. Any other difference refuses the run in one line that lists the first ones.
What was loaded, kept and left unused is said once and recorded (with the file's sha256) in
env.json and summary.json, and in every checkpoint, so a resumed run still names it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from engine import recipe as contract
from engine.weights import files, match, sources
from engine.weights.match import SHOWN
from engine.weights.rebuild import load_model

__all__ = ["load_model"]  # a run's model in plain PyTorch (the rest is the engine's)


def record(path: Path, kind: str, found: match.Match, digest: str, weights: str) -> dict[str, Any]:
    """What the run records about its first weights (env.json, summary.json, checkpoints)."""
    out = {
        "file": str(path),
        "name": path.name,
        "sha256": digest,
        "format": kind,
        "loaded": len(found.loaded),
        "reinitialised": found.reinitialised,
        "unused": found.unused,
    }
    return out | ({"weights": weights} if weights else {})


def describe(rec: dict[str, Any]) -> str:
    """The run's one line about its first weights."""

    def names(items: list[str]) -> str:
        if not items:
            return ""
        more = f", +{len(items) - SHOWN} more" if len(items) > SHOWN else ""
        return f" ({', '.join(items[:SHOWN])}{more})"

    kept, unused = rec["reinitialised"], rec["unused"]
    return (
        f"weights from {rec['file']} ({rec['format']}, sha256 {rec['sha256'][:12]}): loaded "
        f"{rec['loaded']} tensors, re-initialised {len(kept)}{names(kept)}, left unused "
        f"{len(unused)}{names(unused)}"
    )


def start_from(model: nn.Module, model_cfg: Any, is_main: bool) -> dict[str, Any]:
    """Load the configured weights into the model; returns the record (sha256 on rank 0)."""
    path = sources.source_of(model_cfg)
    tensors, kind = files.read(path, model_cfg.init_ema)
    found = match.match(model, tensors, model_cfg.init_skip, model_cfg.init_strict)
    match.load(model, found)
    digest = files.sha256(path) if is_main else ""
    return record(path, kind, found, digest, model_cfg.weights)


def follow_preprocessing(cfg: Any, recipe: Any) -> str:
    """With model.weights, the recipe's data side takes the weights' own preprocessing
    (Recipe.follow_weights, e.g. an image recipe's eval resize and crop). Returns what the
    run uses, in words ("" without named weights)."""
    if not contract.weights_name(cfg.model):
        return ""
    if recipe.follow_weights is None:
        return "the recipe's (its data section has no image preprocessing to set)"
    return recipe.follow_weights(cfg, sources.transforms_of)
