"""Any torchvision classification model, by name (`model.arch=resnet50`, `vit_b_16`, ...), or
any timm model as `model.arch=timm/<name>` (`timm/convnext_tiny`) where timm is installed.
Pure model code: the engine sets num_classes from the data when it is 0. Every model starts
from random weights: nothing is downloaded (weights from a file come through the engine).

The name is checked when the config is read (ModelConfig), so a wrong one is one line before
any data is scanned or any process started. timm is imported only for a `timm/` name: it
adds seconds to the start of every other run."""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass

import torchvision
from torch import nn

from engine.config import ConfigError, bounded

TIMM = "timm/"
TIMM_VERSION = "1.0.31"  # the version requirements.lock pins (tests/recipes/test_timm.py)
EXAMPLES = "e.g. timm/resnet50, timm/convnext_tiny, timm/vit_small_patch16_224"


@dataclass
class ModelConfig:
    # a torchvision classification model (resnet50, vit_b_16, ...), or timm/<name> for a
    # timm model (timm/convnext_tiny; needs timm installed)
    arch: str = "resnet50"
    num_classes: int = bounded(0, ge=0)  # 0: the number of class folders in train/

    def __post_init__(self) -> None:
        check_arch(self.arch)


def check_arch(arch: str) -> None:
    """Raise a one-line ConfigError unless arch names a model build_model can build."""
    if arch.startswith(TIMM):
        check_timm_name(arch)
        return
    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        raise ConfigError(
            f"model.arch={arch!r} is not a torchvision classification model; "
            f"e.g. resnet50, resnet18, efficientnet_b0, vit_b_16 ({len(names)} in all), "
            f"or timm/<name> for a timm model{timm_hint(arch)}"
        )


def timm_hint(arch: str) -> str:
    """A suggestion of timm/<arch> where timm is installed and has that model, else ""."""
    if importlib.util.find_spec("timm") is None:
        return ""
    return f"; did you mean {TIMM + arch}?" if import_timm(arch).is_model(arch) else ""


def import_timm(arch: str):
    """The timm module, or a one-line ConfigError that says how to install it."""
    try:
        import timm  # optional, and start-up time: a second of imports (only timm/ names)
    except ModuleNotFoundError as err:
        if err.name != "timm":
            raise
        raise ConfigError(
            f"model.arch={arch!r} needs timm, which is not installed: "
            f"pip install timm=={TIMM_VERSION} (the version requirements.lock pins), "
            "or pip install -r requirements.lock"
        ) from None
    return timm


def check_timm_name(arch: str) -> None:
    """A timm architecture (timm/convnext_tiny) or one with a pretrained tag
    (timm/convnext_tiny.fb_in1k: the tag's config, e.g. its image size; never its weights)."""
    timm = import_timm(arch)
    name = arch.removeprefix(TIMM)
    known = timm.list_models() if "." not in name else timm.list_pretrained()
    if name in known:
        return
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(TIMM + c for c in close)}?" if close else EXAMPLES
    raise ConfigError(
        f"model.arch={arch!r} is not a timm model ({len(known)} names in "
        f"timm.list_{'models' if '.' not in name else 'pretrained'}()); {hint}"
    )


def build_model(cfg: ModelConfig) -> nn.Module:
    check_arch(cfg.arch)
    if cfg.arch.startswith(TIMM):
        timm = import_timm(cfg.arch)
        name = cfg.arch.removeprefix(TIMM)
        return timm.create_model(name, pretrained=False, num_classes=cfg.num_classes)
    return torchvision.models.get_model(cfg.arch, weights=None, num_classes=cfg.num_classes)
