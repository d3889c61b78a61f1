"""The recipe interface. A recipe is single-device code: a model builder and a dataset
builder, each with a config dataclass of its own. It never touches torch.distributed,
W&B, SLURM or the environment.

A recipe folder holds `config.yaml` and may hold named variants (`v2.yaml`, `fast.yaml`)
layered on it. The first comment line of each file describes it in one line.

Fields the engine reads by name when a recipe's config has them:
  data.root         where the files are; "" resolves to $RECIPES_DATA/<recipe>, else
                    data/<recipe> in the checkout (resolved before the recipe sees it)
  data.skip_bad     replace (deterministically) and count samples whose file cannot be read
  model.num_classes 0 follows the training data (`len(train_dataset.classes)`)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from engine.tasks import Classification


def flip_width(images: torch.Tensor) -> torch.Tensor:
    """Images [..., H, W] mirrored left to right: a Recipe.mirror for image recipes."""
    return images.flip(-1)


@dataclass(frozen=True)
class Recipe:
    model_config: type
    build_model: Callable[..., nn.Module]
    data_config: type
    build_datasets: Callable[..., tuple[Dataset, Dataset]]  # (train, held-out eval)
    # Data-dependent initialisation (model, training dataset), e.g. whitening filters from
    # the images; deterministic, so every rank computes the same weights.
    prepare: Callable[[nn.Module, Dataset], None] | None = None
    # The shape of one input sample given the data config, e.g. (3, 224, 224): the engine
    # counts the model's FLOPs per sample from it and logs MFU where the device's peak is known.
    sample_shape: Callable[..., tuple[int, ...]] | None = None
    # What training minimises and evaluation reports (engine.tasks): classification by default.
    task: Any = field(default_factory=Classification)
    # The units that FSDP shards and activation checkpointing recomputes one at a time, e.g.
    # the transformer blocks (torchtitan's per-block plan); None: the whole model is one unit.
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None
    # init_weights(model_config, name, tensor, generator) fills the parameter or buffer `name`
    # in place. Given, the model is built on the meta device and each tensor is initialised
    # from a generator seeded by (seed, name): the same weights for any world size and
    # strategy, and a model larger than one process's memory can start sharded.
    init_weights: Callable[[Any, str, torch.Tensor, torch.Generator], None] | None = None
    # Declared training FLOPs per sample (forward + backward) from (model config, data config),
    # e.g. 6N + attention per token x tokens; None: counted from sample_shape.
    flops_per_sample: Callable[[Any, Any], float] | None = None
    # Units of the task (e.g. tokens) per sample from the data config: logged as <unit>_per_s.
    units_per_sample: Callable[[Any], int] | None = None
    # The mirror image of an input batch, as likely as the batch itself (e.g. images flipped
    # left to right): eval.hflip_tta averages the predictions of both. None: the inputs have
    # no such view (tokens, features) and eval.hflip_tta is refused.
    mirror: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Another setting that feeds the device faster, named when the loader starves it
    # (e.g. "data.decode=gpu"); "": only workers and storage are suggested.
    faster_input: str = ""
    # The recipe's config keys a resumed run may change without changing what it trains
    # (e.g. "data.download"); the engine's own such keys are in engine.checkpoint.state.
    resume_safe: tuple[str, ...] = ()
    # example_data(root: Path) writes a small dataset in the recipe's real file format under a
    # data root (a few samples a class, seconds to write): the tests train every config on it
    # with data.root=root, and a user can try the recipe before the download. None: the recipe
    # reads no files (its data ships with a package or is generated).
    example_data: Callable[..., None] | None = None
    # check_data(data_config) looks where the data config points (a few directory listings,
    # no file reads) and raises a one-line DataError naming what is missing: launch runs it
    # before starting or queueing anything. None: nothing to look at (packaged or generated).
    check_data: Callable[[Any], None] | None = None
