"""Where named weights are: model.init_from's file or folder, or model.weights' file in
torchvision's local cache (never downloaded: compute nodes have no network)."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError


def wanted(model_cfg: Any) -> bool:
    return bool(getattr(model_cfg, "init_from", "") or getattr(model_cfg, "weights", ""))


def source_of(model_cfg: Any) -> Path:
    """The file or folder named by model.init_from, or model.weights' file in the cache."""
    if model_cfg.init_from and model_cfg.weights:
        raise ConfigError("model.init_from and model.weights both name weights; keep one")
    if model_cfg.weights:
        return published_file(model_cfg.weights)
    path = Path(model_cfg.init_from).expanduser()
    if not path.exists():
        raise ConfigError(f"model.init_from={model_cfg.init_from}: no such file or folder")
    return path


def torchvision_weights(name: str):
    """The torchvision weights entry called `name` (e.g. ResNet50_Weights.IMAGENET1K_V2)."""
    import torchvision  # start-up time: only for named weights

    try:
        return torchvision.models.get_weight(name)
    except (ValueError, KeyError, AttributeError):
        names = [
            f"{type(entry).__name__}.{entry.name}"
            for model in torchvision.models.list_models(module=torchvision.models)
            for entry in torchvision.models.get_model_weights(model)
        ]
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = (
            f"did you mean {', '.join(close)}?" if close else "e.g. ResNet50_Weights.IMAGENET1K_V2"
        )
        raise ConfigError(
            f"model.weights={name!r} is not a torchvision weights name; {hint}"
        ) from None


def published_file(name: str) -> Path:
    """Where torchvision keeps the named weights once downloaded; never downloads them:
    compute nodes have no network, and a run must not depend on one."""
    entry = torchvision_weights(name)
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(entry.url)
    if not path.is_file():
        raise ConfigError(
            f"model.weights={name}: {path} is not in the local cache (runs never download); "
            f"on a machine with network, fetch {entry.url} into $TORCH_HOME/hub/checkpoints/ "
            f"(or run: python -c \"import torchvision; torchvision.models.get_weight('{name}')"
            f'.get_state_dict()") and copy it to {path.parent}/ here'
        )
    return path


def name_hash_warning(path: Path, digest: str) -> str:
    """torchvision names its files <name>-<first hex digits of the sha256>.pth: a file whose
    bytes disagree was altered or replaced (a warning: a site may retrain under the name)."""
    named = re.search(r"-([0-9a-f]{6,64})\.pth?$", path.name)
    if not named or not digest or digest.startswith(named.group(1)):
        return ""
    return (
        f"warning: {path.name} names sha256 {named.group(1)}..., its bytes hash to "
        f"{digest[:12]}...: not the published file"
    )


def transforms_of(name: str) -> Any:
    """The named weights' preprocessing (resize, crop, interpolation, mean, std), as
    torchvision's weights entry gives it: what engine.vision.images.follow_weights follows."""
    return torchvision_weights(name).transforms()
