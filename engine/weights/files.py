"""Reading weights from any file, whatever wrote it: this project's checkpoints (a file
`step-<n>.pt`, a sharded `step-<n>/` gathered into whole tensors in one process, or a run
directory: its newest valid checkpoint; its best/ folder: the best one) and exports (.pt,
.safetensors), torchvision's published state dicts, timm's files (.safetensors,
pytorch_model.bin, and training checkpoints holding state_dict / state_dict_ema / model /
model_ema); the weights or their EMA. Every load is weights-only and wrapper prefixes
(module., _orig_mod.) are dropped. Read by model.init_from, --eval and make export."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from engine import checkpoint as ckpt
from engine.checkpoint import best
from engine.config import ConfigError

TIMM_KEYS = ("state_dict", "model")  # a timm training checkpoint's weights, in this order
TIMM_EMA_KEYS = ("state_dict_ema", "model_ema")


def read(path: Path, ema: bool) -> tuple[dict[str, torch.Tensor], str]:
    """({name: tensor} without wrapper prefixes, what kind of file it was)."""
    if path.is_dir():
        return checkpoint_tensors(newest(path), ema), "checkpoint"
    if path.suffix == ".safetensors":
        return _no_ema(_safetensors(path), ema, path), "safetensors"
    state = _torch_file(path)
    if isinstance(state.get("model"), dict) and "step" in state:  # this project's
        return _tensors(of_state(state, ema, path), path), "checkpoint"
    for keys, kind in ((TIMM_EMA_KEYS, "EMA"), (TIMM_KEYS, "weights")):
        found = [state[k] for k in keys if isinstance(state.get(k), dict)]
        if found and (ema or kind == "weights"):
            return _tensors(found[0], path), f"training checkpoint ({kind})"
    if ema and any(k in state for k in TIMM_KEYS):
        raise ConfigError(
            f"{path} holds no EMA weights ({', '.join(TIMM_EMA_KEYS)}); unset model.init_ema"
        )
    return _no_ema(_tensors(state, path), ema, path), "state dict"


def _torch_file(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (not zip) format cannot be memory-mapped
        state = _plain_load(path)
    except Exception as err:
        raise ConfigError(f"{path} is not a readable weights file ({_reason(err)})") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def _plain_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torn, not torch's, or holding objects weights_only refuses
        raise ConfigError(f"{path} is not a readable weights file ({_reason(err)})") from None


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file  # optional: only for .safetensors
    except ImportError:
        raise ConfigError(
            f"{path}: reading .safetensors needs the safetensors package, which is not "
            "installed: pip install safetensors (the project's requirements.lock has it)"
        ) from None
    try:
        return load_file(str(path))
    except Exception as err:
        raise ConfigError(f"{path} is not a readable safetensors file ({_reason(err)})") from None


def _tensors(state: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    tensors = {k: v for k, v in ckpt.strip_prefixes(state).items() if isinstance(v, torch.Tensor)}
    if not tensors:
        keys = ", ".join(map(str, list(state)[:5]))
        raise ConfigError(f"{path} holds no tensors by name (top-level keys: {keys})")
    return tensors


def _no_ema(tensors: dict[str, torch.Tensor], ema: bool, path: Path) -> dict[str, torch.Tensor]:
    if ema:
        raise ConfigError(f"{path} holds one set of weights, no EMA of them; unset model.init_ema")
    return ckpt.strip_prefixes(tensors)


def _reason(err: Exception) -> str:
    text = " ".join(str(err).split()).split(". ")[0][:160]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def sha256(path: Path) -> str:
    """The file's sha256; a folder's: over its files' relative names and bytes, in order."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- this project's checkpoints


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


def checkpoint_tensors(path: Path, ema: bool) -> dict[str, torch.Tensor]:
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
