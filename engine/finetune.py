"""Starting from weights trained elsewhere: `model.init_from=PATH`, `model.weights=NAME`.

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

import difflib
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine import checkpoint as ckpt
from engine.checkpoint import weights as checkpoint_weights
from engine.config import ConfigError, finalize
from engine.optim import check_patterns, matches, note

SHOWN = 5  # names listed per kind in the run's message
TIMM_KEYS = ("state_dict", "model")  # a timm training checkpoint's weights, in this order
TIMM_EMA_KEYS = ("state_dict_ema", "model_ema")


# ---------------------------------------------------------------- where the weights are


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


# ---------------------------------------------------------------- reading any format


def read(path: Path, ema: bool) -> tuple[dict[str, torch.Tensor], str]:
    """({name: tensor} without wrapper prefixes, what kind of file it was)."""
    if path.is_dir():
        return checkpoint_weights.read(checkpoint_weights.newest(path), ema), "checkpoint"
    if path.suffix == ".safetensors":
        return _no_ema(_safetensors(path), ema, path), "safetensors"
    state = _torch_file(path)
    if isinstance(state.get("model"), dict) and "step" in state:  # this project's
        return _tensors(checkpoint_weights.of_state(state, ema, path), path), "checkpoint"
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


# ---------------------------------------------------------------- matching


@dataclass
class Match:
    """The model's tensors against the file's."""

    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    reinitialised: list[str] = field(default_factory=list)  # kept as the seed made them
    unused: list[str] = field(default_factory=list)  # in the file, not in the model


def classifier(model: nn.Module) -> set[str]:
    """The names of the output layer's tensors: the last Linear (else 1x1-capable Conv)
    registered, the layer a head for another number of classes replaces."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    layers = layers or [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    if not layers:
        return set()
    name, layer = layers[-1]
    return {f"{name}.{t}" if name else t for t, _ in layer.named_parameters(recurse=False)}


def match(
    model: nn.Module, tensors: dict[str, torch.Tensor], skip: list[str], strict: bool
) -> Match:
    """Which of the model's tensors load from the file; a ConfigError for any difference
    that is not the classifier's size (or, with strict, for any difference at all)."""
    expected = unwrapped_state(model)
    head = classifier(ckpt.unwrap(model))
    check_patterns("model.init_skip", skip, expected)
    out, problems = Match(), []
    for name, mine in expected.items():
        theirs = tensors.get(name)
        if matches(name, skip):
            out.reinitialised.append(name)
        elif theirs is None:
            problems.append(f"{name} missing from the file")
        elif tuple(theirs.shape) == tuple(mine.shape):
            out.loaded[name] = theirs
        elif name in head and theirs.shape[1:] == mine.shape[1:] and not strict:
            out.reinitialised.append(name)
        else:
            problems.append(f"{name} {list(theirs.shape)} in the file, {list(mine.shape)} here")
    out.unused = [name for name in tensors if name not in expected]
    if strict and out.unused:
        problems += [f"{name} in the file, not in the model" for name in out.unused]
    if problems:
        shown = "; ".join(problems[:SHOWN]) + ("; ..." if len(problems) > SHOWN else "")
        raise ConfigError(
            f"the weights do not fit this model ({len(problems)} differences: {shown}); check "
            "model.arch and the file, or keep such tensors as initialised with "
            "model.init_skip=[PATTERN]"
        )
    return out


def unwrapped_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return ckpt.strip_prefixes(ckpt.unwrap(model).state_dict())


# ---------------------------------------------------------------- loading and telling


@torch.no_grad()
def load(model: nn.Module, found: Match) -> None:
    """Copy the matched tensors into the model, whole (each process holds the full model)
    or into each process's shards (FSDP: every process read the whole file)."""
    bare = ckpt.unwrap(model)
    if any(_is_dtensor(t) for t in bare.state_dict().values()):
        from torch.distributed.checkpoint.state_dict import (  # start-up time: DCP
            StateDictOptions,
            set_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(bare, found.loaded, options=options)
        return
    missing = bare.load_state_dict(found.loaded, strict=False).missing_keys
    assert set(missing) == set(found.reinitialised), "every other tensor was matched"


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def record(path: Path, kind: str, found: Match, digest: str, weights: str) -> dict[str, Any]:
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
    path = source_of(model_cfg)
    tensors, kind = read(path, model_cfg.init_ema)
    found = match(model, tensors, model_cfg.init_skip, model_cfg.init_strict)
    load(model, found)
    digest = sha256(path) if is_main else ""
    return record(path, kind, found, digest, model_cfg.weights)


# ---------------------------------------------------------------- what trains


def freeze(model: nn.Module, patterns: list[str]) -> None:
    """optim.freeze: matching parameters take no gradient (and so no optimizer state)."""
    if not patterns:
        return
    named = dict(ckpt.unwrap(model).named_parameters())
    check_patterns("optim.freeze", patterns, named)
    frozen = [name for name in named if matches(name, patterns)]
    for name in frozen:
        named[name].requires_grad_(False)
    note(frozen_line(patterns, len(frozen), len(named)))


def frozen_line(patterns: list[str], frozen: int, tensors: int) -> str:
    """optim.freeze in one line: how many patterns, the tensors they froze, the patterns."""
    shown = ", ".join(patterns[:SHOWN]) + (", ..." if len(patterns) > SHOWN else "")
    plural = "s" if len(patterns) > 1 else ""
    return f"frozen: {len(patterns)} pattern{plural}, {frozen} of {tensors} tensors ({shown})"


# ---------------------------------------------------------------- the weights' preprocessing


def follow_weights(cfg: Any) -> str:
    """With model.weights, the image recipe's eval resize, crop and interpolation become the
    weights' own (unless data.augment.follow_weights=false), set through config.finalize so
    the saved config and a resume see them. Returns what the run uses, in words ("" for no
    weights named)."""
    name = getattr(cfg.model, "weights", "")
    augment = getattr(cfg.data, "augment", None)
    if not name:
        return ""
    if not hasattr(augment, "follow_weights"):
        return "the recipe's (its data section has no image preprocessing to set)"
    if not augment.follow_weights:
        return "the config's (data.augment.follow_weights=false)"
    ours = torchvision_weights(name).transforms()
    from engine.data.images import IMAGENET_MEAN, IMAGENET_STD  # start-up time: transforms

    if not _same(ours.mean, IMAGENET_MEAN) or not _same(ours.std, IMAGENET_STD):
        raise ConfigError(
            f"model.weights={name} normalises with mean {list(ours.mean)}, std {list(ours.std)}; "
            "the image pipeline uses ImageNet's: set data.augment.follow_weights=false to go on"
        )
    derived = {
        "data.augment.eval_resize": ours.resize_size[0],
        "data.augment.eval_size": ours.crop_size[0],
        "data.augment.interpolation": ours.interpolation.value,
    }
    finalize(cfg, derived)
    return (
        f"the weights' ({name}): resize {augment.eval_resize}, crop {augment.eval_size}, "
        f"{augment.interpolation}"
    )


def _same(a, b) -> bool:
    return all(abs(x - y) < 1e-6 for x, y in zip(a, b, strict=True))
