"""Small ImageNet-layout folders of real JPEG files for the tests (the imagenet recipe's own
example data, recipes/imagenet/example.py, settled), and the bad files a real dataset holds
(not an image, truncated, empty, a PNG or CMYK JPEG under a .JPEG name)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image

from recipes.imagenet import example
from recipes.imagenet.example import picture, wnid

__all__ = [
    "SMALL_ARCH",
    "jpeg_bytes",
    "plant_empty_file",
    "plant_jpeg",
    "plant_not_an_image",
    "plant_png_as_jpeg",
    "plant_truncated_jpeg",
    "settle",
    "wnid",
    "write_image_folder",
]

# The model of the tests that train on these folders, whose subject is the data path, the
# loop or the checkpoint, not the model: torchvision's smallest with batch norm and an `fc`
# head (1.4 M parameters). A 6-step run trained and checkpointed in ~1 s instead of resnet18's
# ~4 s (11.7 M; 2026-12-07, the 2-core AVX2 machine). Tests of a model format keep theirs.
SMALL_ARCH = "shufflenet_v2_x0_5"


def jpeg_bytes(size: tuple[int, int] = (40, 48), seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    picture(rng, rng.uniform(0, 255, 3), size).convert(mode).save(out, format="JPEG")
    return out.getvalue()


def settle(root: Path, age_s: float = 60) -> None:
    """Dates every folder under root age_s back, as data that has not changed for a while
    (the index cache is written only for such data)."""
    then = time.time() - age_s
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.utime(folder, (then, then))


def write_image_folder(
    root: Path,
    classes: int = 3,
    train_per_class: int = 6,
    val_per_class: int = 2,
    size: tuple[int, int] = (40, 48),
    seed: int = 0,
) -> Path:
    """The imagenet recipe's example data (root/train/<wnid>/<wnid>_<i>.JPEG and
    root/val/<wnid>/ILSVRC2012_val_<n>.JPEG, each class in its own colour, sizes (height,
    width) varying around size), settled so that its index is cached; returns root."""
    example.write_image_folder(root, classes, train_per_class, val_per_class, size, seed)
    settle(root)
    return root


def plant_not_an_image(path: Path) -> Path:
    path.write_text("<html>404 Not Found</html>\n")  # what a failed download leaves behind
    return path


def plant_truncated_jpeg(path: Path, keep: float = 0.5) -> Path:
    data = jpeg_bytes(seed=1)
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def plant_empty_file(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def plant_png_as_jpeg(path: Path) -> Path:
    """ImageNet's train set holds one such file (n02105855_2933.JPEG)."""
    Image.open(io.BytesIO(jpeg_bytes(seed=2))).save(path, format="PNG")
    return path


def plant_jpeg(path: Path, mode: str) -> Path:
    """A JPEG in another colour mode: "CMYK" (22 of ImageNet's train files) or "L" (grey)."""
    path.write_bytes(jpeg_bytes(seed=3, mode=mode))
    return path
