"""A folder of real ImageNet-sized JPEG photos in ImageNet's layout, made offline.

The pixels come from the two photographs scikit-learn ships (`load_sample_images`): each file
is a random crop of one, scaled to a random ImageNet-like size (shorter side 300-500 px,
aspect 3:4 to 4:3) and saved at quality 75-95, so decoding costs what a real ImageNet file
costs (flat colour or noise would decode faster or slower than photographs). Deterministic
in `seed`."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
from PIL import Image

NO_SKLEARN = (
    "the JPEG folder is made from scikit-learn's sample photographs, and scikit-learn is not "
    "installed: pip install scikit-learn (the project's requirements.lock has it)"
)


def missing_photos() -> str | None:
    """Why the photographs cannot be had (scikit-learn is not installed), or None."""
    try:
        found = importlib.util.find_spec("sklearn") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else NO_SKLEARN


def _photos() -> list[Image.Image]:
    try:
        from sklearn.datasets import load_sample_images  # optional: a site image may lack it
    except ImportError:
        raise RuntimeError(NO_SKLEARN) from None
    return [Image.fromarray(pixels) for pixels in load_sample_images().images]


def _picture(rng: np.random.Generator, photo: Image.Image) -> Image.Image:
    width, height = photo.size
    crop_w = int(rng.uniform(0.5, 1.0) * width)
    crop_h = int(rng.uniform(0.5, 1.0) * height)
    left = int(rng.integers(0, width - crop_w + 1))
    top = int(rng.integers(0, height - crop_h + 1))
    short = int(rng.uniform(300, 500))
    aspect = rng.uniform(3 / 4, 4 / 3)
    size = (short, int(short * aspect)) if rng.random() < 0.5 else (int(short * aspect), short)
    picture = photo.crop((left, top, left + crop_w, top + crop_h)).resize(size, Image.BILINEAR)
    return picture.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else picture


def write_jpeg_folder(
    root: Path, classes: int = 4, train_per_class: int = 32, val_per_class: int = 8, seed: int = 0
) -> Path:
    """root/train/<class>/*.JPEG and root/val/<class>/*.JPEG; returns root. Class k draws from
    photo k % 2, so a model can learn something, though that is not the point."""
    rng = np.random.default_rng(seed)
    photos = _photos()
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for k in range(classes):
            folder = root / split / f"n{k:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                picture = _picture(rng, photos[k % len(photos)])
                quality = int(rng.integers(75, 96))
                picture.save(folder / f"n{k:08d}_{i}.JPEG", quality=quality)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--train-per-class", type=int, default=32)
    parser.add_argument("--val-per-class", type=int, default=8)
    args = parser.parse_args()
    if reason := missing_photos():
        sys.exit(f"error: {reason}")
    write_jpeg_folder(args.root, args.classes, args.train_per_class, args.val_per_class)
    print(args.root)


if __name__ == "__main__":
    main()
