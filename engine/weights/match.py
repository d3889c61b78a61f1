"""Matching a file's tensors to the model by name and shape, and loading them.

A tensor whose shape differs only in the classifier's output rows (a head for another number
of classes), or whose name matches model.init_skip, keeps the weights the run's seed gave it;
a tensor the model lacks is left unused. Any other difference refuses the run in one line
that lists the first ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine import checkpoint as ckpt
from engine.config import ConfigError
from engine.optim import check_patterns, matches

SHOWN = 5  # names listed per kind in a message


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
