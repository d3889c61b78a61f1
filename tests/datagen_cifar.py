"""CIFAR-10 for the tests: the official python-batch format is written by the recipe's own
recipes/cifar10/example.py (re-exported here), and a doctored batch for the security tests."""

from __future__ import annotations

import pickle
import shlex
from pathlib import Path

import numpy as np

from recipes.cifar10.example import CLASSES, images_for, write_cifar_batches

__all__ = ["CLASSES", "images_for", "write_cifar_batches", "write_doctored_batch"]


class _RunsCode:
    """Unpickles to a call of `func(arg)`: what a doctored batch uses to run code."""

    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


def write_doctored_batch(path: Path, func=exec) -> Path:
    """Writes an otherwise valid batch whose unpickling calls func (default builtins.exec) to
    create a marker file; returns the marker's path, which exists only if the code ran.
    func=os.system gets a shell command instead of python source."""
    marker = Path(path).with_name(Path(path).name + ".ran")
    arg = (
        f"touch {shlex.quote(str(marker))}"
        if func.__name__ == "system"
        else f"open({str(marker)!r}, 'w').close()"
    )
    labels = np.zeros(2, dtype=np.int64)
    batch = {
        b"batch_label": b"training batch 1 of 5",
        b"labels": [0, 0],
        b"data": images_for(labels, np.random.default_rng(0)),
        b"filenames": _RunsCode(func, arg),
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)
    return marker
