"""The model weights in this project's checkpoints, whatever their kind: a file `step-<n>.pt`,
a sharded `step-<n>/` (gathered into whole tensors in one process), or a run directory (its
newest checkpoint that loads; its best/ folder: the best one); the weights or their EMA. Read by model.init_from and --eval."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine import checkpoint as ckpt
from engine.checkpoint import best
from engine.config import ConfigError


def is_sharded(path: Path) -> bool:
    return path.is_dir() and ((path / ".metadata").exists() or (path / "meta.pt").exists())


def newest(path: Path) -> Path:
    """A checkpoint as given; a run's best/ folder: its best one (engine.checkpoint.best); a
    run directory (or its checkpoints folder): the newest valid one."""
    if path.is_file() or is_sharded(path):
        return path
    if path.name == best.FOLDER and (path.parent / "checkpoints").is_dir():
        ranked = best.ranking(path, ckpt.load)
        if not ranked:
            raise ConfigError(f"{path} holds no best checkpoint")
        return ranked[0][0]
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = ckpt.latest_valid(folder)
    if found is None:
        raise ConfigError(
            f"{path} is not a checkpoint (step-N.pt or step-N/) nor a run directory holding one"
        )
    return found[0]


def of_state(state: dict[str, Any], ema: bool, path: Path) -> dict[str, Any]:
    """A file checkpoint's weights, or their average (engine.ema's layout: state["ema"] =
    {"model": the averaged module's state dict, "n_averaged": ...})."""
    if not ema:
        return state["model"]
    average = state.get("ema")
    if not isinstance(average, dict) or not isinstance(average.get("model"), dict):
        raise ConfigError(f"{path} holds no EMA of the weights (trained with ema.decay=0?)")
    return average["model"]


def read(path: Path, ema: bool) -> dict[str, torch.Tensor]:
    """The weights (or their EMA) of a checkpoint file or sharded directory, as whole CPU
    tensors named without wrapper prefixes."""
    if not path.is_dir():
        return bare(of_state(ckpt.load(path), ema, path))
    from engine.checkpoint import sharded  # start-up time: imports DCP

    try:
        return bare(
            of_state(sharded.read_meta(path), ema, path) if ema else sharded.model_tensors(path)
        )
    except ConfigError:
        raise
    except Exception as err:  # a directory that is not (or not wholly) a checkpoint
        raise ConfigError(
            f"{path} is not a complete sharded checkpoint ({ckpt.reason(err)})"
        ) from None


def bare(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a state dict on the CPU, without wrapper prefixes (nor the EMA's count)."""
    return {
        name: value.detach().cpu()
        for name, value in ckpt.strip_prefixes(weights).items()
        if isinstance(value, torch.Tensor) and name != "n_averaged"
    }
