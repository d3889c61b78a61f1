"""The recipe contract, whole: every name the engine reads from a recipe. A recipe is
single-device code: a model builder and a dataset builder, each with a config dataclass of
its own. It never touches torch.distributed, W&B, SLURM or the environment.

A recipe folder holds `config.yaml` and may hold named variants (`v2.yaml`, `fast.yaml`)
layered on it. The first comment line of each file describes it in one line.

Three kinds of names, and the engine reads no others (tests/engine/test_recipe_contract.py
holds it to that):
- the hooks of `Recipe` below, registered in the folder's recipe.py;
- fields of the recipe's own config sections, read only through the functions under "The
  config sections" (data.root, data.path, data.skip_bad, model.num_classes, model.weights,
  and the image pipeline's data.augment section);
- attributes of its datasets, read only through the functions under "The datasets"
  (classes, set_epoch, load_batch, finish_on_device, finishes_ahead, fingerprint).

This module imports neither torch nor the rest of the engine: the launcher (torch-free) and
every layer of the engine read the contract from the same place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset


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
    # What training minimises and evaluation reports (engine.tasks.Task; read through
    # engine.tasks.task_of): None is classification (engine.tasks.Classification).
    task: Any = None
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
    # follow_weights(config, transforms_of) sets the data section's preprocessing to the
    # named weights' own (model.weights; transforms_of(name) gives torchvision's transforms
    # of those weights) through config.finalize, and says in words what the run uses: image
    # recipes give engine.vision.images.follow_weights. None: the data keeps its own.
    follow_weights: Callable[[Any, Callable[[str], Any]], str] | None = None
    # check_data(data_config) looks where the data config points (a few directory listings,
    # no file reads) and raises a one-line DataError naming what is missing: launch runs it
    # before starting or queueing anything. None: nothing to look at (packaged or generated).
    check_data: Callable[[Any], None] | None = None
    # count_samples(data_config) gives the training set's size where it is known without
    # reading the data (a file's size, a packaged set's count; None: this machine cannot see
    # it): launch's check refuses a global batch larger than the set before the queue, where
    # the sampler would refuse it only on the node. None: the recipe cannot count cheaply.
    count_samples: Callable[[Any], int | None] | None = None
    # make_shards(data_config) packs the data at data.root into a few large files that
    # training reads instead (make shards; image recipes: engine.vision.shards), with progress,
    # and continues where a stopped run left off. None: the recipe's data has no shard form.
    make_shards: Callable[[Any], None] | None = None
    # Tensor parallelism (dist.tp): parallelize(model, mesh) applies the model's plan in place
    # on the 1-D tensor-parallel mesh (torch's parallelize_module; the engine owns the mesh,
    # FSDP and the rest), and check_tp(model_config, data_config, tp) raises a one-line
    # ConfigError for what the plan cannot split (e.g. heads not divisible by tp). None: the
    # model has no plan and dist.tp > 1 is refused.
    parallelize: Callable[[nn.Module, Any], None] | None = None
    check_tp: Callable[[Any, Any, int], None] | None = None


# ---------------------------------------------------------------- the config sections


def data_root(data: Any) -> str | None:
    """data.root: where the files are; "" resolves to $RECIPES_DATA/<recipe>, else
    data/<recipe> in the checkout, before the recipe sees it. None: the recipe reads no
    folder of files (its data ships with a package, is generated, or is one data.path)."""
    return data.root if hasattr(data, "root") else None


def data_location(data: Any) -> str:
    """What a recipe reads, for messages: data.root, else a single file's data.path."""
    return data_root(data) or getattr(data, "path", "") or ""


def skip_bad(data: Any) -> bool:
    """data.skip_bad: replace (deterministically) and count samples whose file cannot be read."""
    return bool(getattr(data, "skip_bad", False))


def num_classes(model: Any) -> int | None:
    """model.num_classes: the classifier's outputs; 0 follows the training data
    (`classes` below); None: the model declares none (not a classifier)."""
    return getattr(model, "num_classes", None)


def weights_name(model: Any) -> str:
    """model.weights: torchvision weights by name (engine.config's ModelInit section, where a
    recipe's model section embeds it), whose preprocessing the image pipeline may follow."""
    return getattr(model, "weights", "") or ""


def augment(data: Any) -> Any:
    """data.augment: the image pipeline's own section (engine.vision.images.AugmentConfig and
    its eval_resize, eval_size, interpolation, follow_weights), where a recipe embeds it."""
    return getattr(data, "augment", None)


# ---------------------------------------------------------------- the datasets


def classes(dataset: Any) -> list | None:
    """The class names of a training set, which model.num_classes=0 follows."""
    return getattr(dataset, "classes", None)


def epoch_hook(dataset: Any) -> Callable[[int], None] | None:
    """set_epoch(epoch), called in every loader worker before an epoch (progressive resizing)."""
    return getattr(dataset, "set_epoch", None)


def batch_loader(dataset: Any) -> Callable[[Any], tuple[Any, Any]] | None:
    """load_batch(index tensor) -> (x, y): a dataset's loader of whole batches, which
    declares that it returns default_collate([dataset[i] for i in index]) bit for bit,
    draws no randomness and cannot meet an unreadable sample (engine.data.loaders)."""
    return getattr(dataset, "load_batch", None)


def finishes_ahead(dataset: Any) -> bool:
    """finishes_ahead: the dataset's finish_on_device may run on a thread one batch ahead of
    the step (decode=gpu's DeviceDecodedFiles; engine.data.prefetch)."""
    return bool(getattr(dataset, "finishes_ahead", False))


def device_finisher(dataset: Any) -> Callable[[Any, Any], Any] | None:
    """finish_on_device(batch, device): the batch finished on the device (uint8 images
    normalised, or JPEG bytes decoded there) instead of a plain copy."""
    return getattr(dataset, "finish_on_device", None)


def fingerprinter(dataset: Any) -> Callable[[bool], dict] | None:
    """fingerprint(content) -> dict: the dataset's own fingerprint of its data
    (engine.data.fingerprint's form): a folder of files by its index, or with content=True
    by the files' bytes; None: the engine's generic one (its tensors' bytes)."""
    return getattr(dataset, "fingerprint", None)
