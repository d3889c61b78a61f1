"""A small CIFAR-10 in the official python-batch format (`<root>/cifar-10-batches-py/`), for
the tests and a first try without the download (Recipe.example_data). Each class has its own
mean colour plus noise, so a small model can learn something."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np

CLASSES = ["airplane", "automobile", "bird", "cat", "deer"]
CLASSES += ["dog", "frog", "horse", "ship", "truck"]
try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct


class _Python2Pickler(pickle._Pickler):
    """Writes what python 2's cPickle wrote into the official files: every string as a python 2
    `str` (SHORT_BINSTRING / BINSTRING, also the array's raw bytes) and numpy's _reconstruct
    under its numpy-1 name, so a reader sees the official opcodes and globals."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_str8(self, obj):
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[str] = dispatch[bytes] = save_str8

    def save_global(self, obj, name=None):
        if obj is not _reconstruct:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
        self.memoize(obj)


def _dump(obj, path: Path, python2: bool) -> None:
    with open(path, "wb") as f:
        if python2:
            _Python2Pickler(f, protocol=2).dump(obj)
        else:  # python3's own protocol 2: bytes go through _codecs.encode(str, "latin1")
            pickle.dump(obj, f, protocol=2)


def images_for(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(n, 3072) uint8 official rows: a class colour (R, G, B planes) plus noise."""
    colours = np.random.default_rng(1234).integers(40, 216, size=(10, 3))  # fixed across seeds
    planes = colours[labels][:, :, None] + rng.normal(0, 25, size=(len(labels), 3, 1024))
    return planes.clip(0, 255).astype(np.uint8).reshape(len(labels), 3072)


def write_cifar_batches(
    root: Path, n_train: int = 100, n_test: int = 50, seed: int = 0, *, python2: bool = True
) -> Path:
    """Writes `<root>/cifar-10-batches-py/` (data_batch_1..5, test_batch, batches.meta) and
    returns root. Keys and strings are bytes, as the official python 2 `str` values are; by
    default written with python 2's opcodes (the closest to the official files), with
    python2=False by python3's pickle at protocol 2 (a re-creation as a python3 user writes it)."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = [len(part) for part in np.array_split(np.arange(n_train), 5)] + [n_test]
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    titles = [f"training batch {i} of 5" for i in range(1, 6)] + ["testing batch 1 of 1"]
    for name, title, n in zip(names, titles, sizes, strict=True):
        labels = rng.integers(0, 10, size=n)
        batch = {
            b"batch_label": title.encode(),
            b"labels": [int(y) for y in labels],
            b"data": images_for(labels, rng),
            b"filenames": [f"{CLASSES[y]}_s_{i:06d}.png".encode() for i, y in enumerate(labels)],
        }
        _dump(batch, folder / name, python2)
    meta = {
        b"label_names": [c.encode() for c in CLASSES],
        b"num_cases_per_batch": max(sizes),
        b"num_vis": 3072,
    }
    _dump(meta, folder / "batches.meta", python2)
    return Path(root)


def write_example(root: Path) -> None:
    """40 training and 20 test images at root, as the official files hold them: seconds of
    training for every config in the tests (data.root=root)."""
    write_cifar_batches(root, n_train=40, n_test=20)
