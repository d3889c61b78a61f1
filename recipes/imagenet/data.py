"""ImageNet in its folder layout (`train/<wnid>/*.JPEG`, `val/<wnid>/*.JPEG` at data.root),
decoded and augmented per sample by the engine's image pipeline (or, with `decode: gpu`,
decoded and augmented on the training device per batch); with `format: shards`, the same
files read from the tar shards `make shards RECIPE=imagenet` wrote (engine.vision.shards);
or, with `synthetic`, random images of the same shape, to measure throughput without data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from torch.utils.data import Dataset

from engine.config import ConfigError, bounded
from engine.vision.gpu_decode import DeviceDecodedFiles, check_augment
from engine.vision.imagefolder import (
    FolderHelp,
    FolderIndex,
    ImageFiles,
    check_layout,
    folder_indexes,
)
from engine.vision.images import ImageAugment, TrainTransform, eval_transform
from engine.vision.shards import ShardImages, load_split, read_index, write_shards
from engine.vision.synthetic import SyntheticImages

# What the layout's errors tell a user who has no ImageNet at data.root yet.
HELP = FolderHelp(
    name="ImageNet",
    files="*.JPEG",
    source="get ImageNet from image-net.org, with val/ sorted into class folders "
    "(e.g. by the valprep.sh script)",
    sort="val/ as downloaded is flat: sort it into class folders, e.g. by valprep.sh",
)
MAKE_SHARDS = "make shards RECIPE=imagenet"


@dataclass
class DataConfig:
    root: str = ""  # "": $RECIPES_DATA/imagenet or data/imagenet in the checkout
    index_cache: str = ""  # "": beside the data when writable, else ~/.cache/recipes/index
    skip_bad: bool = False  # replace and count unreadable files instead of stopping
    # gpu: workers read the files and draw the crops; the device decodes (nvJPEG on CUDA),
    # crops and flips whole batches. No trivial_augment or random_erasing; a file that fails
    # only on the device stops the run even with skip_bad. Not used with synthetic data.
    decode: Literal["cpu", "gpu"] = "cpu"
    # decode=gpu: this share of the JPEGs (a fixed choice per file) is decoded by the loader
    # workers instead, as DALI's hw_decoder_load: CPU cores left idle by decode=gpu take part
    # of the decoding off the device. bench/gpu.sh measures the split; 0: the device decodes all
    cpu_decode_share: float = bounded(0.0, ge=0.0, le=1.0)
    # folder: the class folders at data.root; shards: the same images from the tar shards
    # that `make shards RECIPE=imagenet` writes (a few large files instead of one per image,
    # for shared file systems); the same bytes, so the same training, bit for bit
    format: Literal["folder", "shards"] = "folder"
    shards: str = ""  # where make shards writes and data.format=shards reads; "": <root>/shards
    shard_mb: float = bounded(1024.0, gt=0.0)  # make shards: MB of images per shard
    # a node-local folder (e.g. /tmp or local NVMe): every shard is copied there once per
    # node, whole or not at all, and read from there; "": read where data.shards is
    shard_cache: str = ""
    synthetic: bool = False  # random images: throughput with no data on disk
    synthetic_train: int = bounded(1_281_167, ge=1)  # ImageNet-1k's sizes
    synthetic_val: int = bounded(50_000, ge=1)
    synthetic_classes: int = bounded(1000, ge=1)
    augment: ImageAugment = field(default_factory=ImageAugment)


def imagenet_indexes(root: Path, cache_dir: Path | None = None) -> tuple[FolderIndex, FolderIndex]:
    """The (train, val) indexes of ImageNet at root, or a one-line DataError saying where to
    get it and how to lay it out."""
    return folder_indexes(root, cache_dir, HELP)


def shards_folder(cfg: DataConfig) -> Path:
    return Path(cfg.shards) if cfg.shards else Path(cfg.root) / "shards"


def check_data(cfg: DataConfig) -> None:
    """ImageNet's folders at data.root, or the shards' index (no file is read), unless the
    data is synthetic."""
    check_decode(cfg)
    if cfg.synthetic:
        return
    if cfg.format == "shards":
        read_index(shards_folder(cfg), MAKE_SHARDS)
    else:
        check_layout(Path(cfg.root), HELP)


def make_shards(cfg: DataConfig) -> None:
    """make shards RECIPE=imagenet: the class folders at data.root as shards in data.shards."""
    cache = Path(cfg.index_cache) if cfg.index_cache else None
    size = int(cfg.shard_mb * 1e6)
    write_shards(Path(cfg.root), shards_folder(cfg), size, HELP, cache)


def check_decode(cfg: DataConfig) -> None:
    if cfg.cpu_decode_share > 0 and (cfg.decode != "gpu" or cfg.synthetic):
        raise ConfigError(
            f"data.cpu_decode_share={cfg.cpu_decode_share} splits decode=gpu's decoding with "
            "the loader workers: set data.decode=gpu with files, or leave the share at 0"
        )
    if cfg.format == "shards" and cfg.decode == "gpu" and not cfg.synthetic:
        raise ConfigError(
            "data.decode=gpu reads the class folders: use data.format=folder with it, or "
            "data.decode=cpu with data.format=shards"
        )


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    check_decode(cfg)
    aug = cfg.augment
    if cfg.synthetic:
        return (
            SyntheticImages(cfg.synthetic_train, cfg.synthetic_classes, aug.train_size),
            SyntheticImages(cfg.synthetic_val, cfg.synthetic_classes, aug.eval_size),
        )
    if cfg.decode == "gpu":
        check_augment(aug)  # a config mistake: said before the data is read
    if cfg.format == "shards":
        return shard_datasets(cfg)
    cache = Path(cfg.index_cache) if cfg.index_cache else None
    train, val = imagenet_indexes(Path(cfg.root), cache)
    if cfg.decode == "gpu":
        share = cfg.cpu_decode_share
        return (
            DeviceDecodedFiles(train, aug, train=True, cpu_share=share),
            DeviceDecodedFiles(val, aug, train=False, cpu_share=share),
        )
    return ImageFiles(train, TrainTransform(aug)), ImageFiles(val, eval_transform(aug))


def shard_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    folder, aug = shards_folder(cfg), cfg.augment
    train, val = (load_split(folder, s, MAKE_SHARDS, cfg.shard_cache) for s in ("train", "val"))
    return (
        ShardImages(train, TrainTransform(aug), command=MAKE_SHARDS),
        ShardImages(val, eval_transform(aug), command=MAKE_SHARDS),
    )
