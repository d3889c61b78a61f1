"""A small ImageNet in its real layout and file names, for the tests and a first try without
the download (Recipe.example_data): `train/<wnid>/<wnid>_<i>.JPEG` and
`val/<wnid>/ILSVRC2012_val_<n>.JPEG`, real JPEG files, each class in its own colour plus noise
(learnable), sizes varying around a given one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def wnid(k: int) -> str:
    """A WordNet-id-shaped class folder name, as ImageNet's (n01440764)."""
    return f"n{k:08d}"


def picture(rng: np.random.Generator, colour: np.ndarray, size: tuple[int, int]) -> Image.Image:
    """A class colour with noise, at a size within ±20% of size (height, width)."""
    h, w = (int(s * rng.uniform(0.8, 1.2)) for s in size)
    pixels = colour + rng.normal(0, 25, (h, w, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def write_image_folder(
    root: Path,
    classes: int = 3,
    train_per_class: int = 6,
    val_per_class: int = 2,
    size: tuple[int, int] = (40, 48),
    seed: int = 0,
) -> Path:
    """root/train/<wnid>/<wnid>_<i>.JPEG and root/val/<wnid>/ILSVRC2012_val_<n>.JPEG (n counts
    on across classes, as ImageNet's validation files); returns root."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    colours = rng.uniform(0, 255, (classes, 3))
    val_number = 0
    for k in range(classes):
        train_dir, val_dir = root / "train" / wnid(k), root / "val" / wnid(k)
        train_dir.mkdir(parents=True)
        val_dir.mkdir(parents=True)
        for i in range(train_per_class):
            picture(rng, colours[k], size).save(train_dir / f"{wnid(k)}_{i}.JPEG")
        for _ in range(val_per_class):
            val_number += 1
            picture(rng, colours[k], size).save(val_dir / f"ILSVRC2012_val_{val_number:08d}.JPEG")
    return root


def write_example(root: Path) -> None:
    """3 classes of 6 training and 2 validation images at root: seconds of training for every
    config in the tests (data.root=root)."""
    write_image_folder(root)
