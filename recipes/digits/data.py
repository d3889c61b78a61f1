"""The UCI handwritten digits that scikit-learn ships (1797 8x8 images, no download).

The train/test split is fixed (its own seed, stratified) and never depends on the training
seed, so runs with different seeds are evaluated on the same held-out images."""

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from engine.config import ConfigError, bounded

SPLIT_SEED = 20240611


@dataclass
class DataConfig:
    test_fraction: float = bounded(0.2, gt=0, lt=1)
    shift: int = bounded(1, ge=0)  # random translation of up to this many pixels (training only)


class Digits(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shift: int = 0):
        self.images, self.labels, self.shift = images, labels, shift

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = self.images[i]
        if self.shift:
            dy, dx = torch.randint(-self.shift, self.shift + 1, (2,)).tolist()
            image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
        return image, self.labels[i]


def digits_table() -> tuple[np.ndarray, np.ndarray]:
    """(1797 8x8 images with values 0-16, labels): the CSV scikit-learn ships, read directly,
    as its load_digits() does; importing sklearn.datasets would add seconds to every start.
    Without scikit-learn, a one-line error that names it."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "recipe digits reads the digits data that scikit-learn ships, and scikit-learn is "
            "not installed: pip install scikit-learn (the project's requirements.lock has it)"
        )
    table = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not table.exists():  # another scikit-learn layout: its own loader
        from sklearn.datasets import load_digits  # start-up time: seconds, rarely needed

        digits = load_digits()
        return digits.images, digits.target
    data = np.loadtxt(table, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def load_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = digits_table()
    images = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    return (images - 0.5) / 0.5, torch.tensor(labels, dtype=torch.long)


def split(labels: torch.Tensor, test_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Stratified split with a fixed seed: the same held-out set for every run."""
    gen = torch.Generator().manual_seed(SPLIT_SEED)
    train, test = [], []
    for c in labels.unique().tolist():
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        n_test = round(len(idx) * test_fraction)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    images, labels = load_arrays()
    train_idx, test_idx = split(labels, cfg.test_fraction)
    return (
        Digits(images[train_idx], labels[train_idx], shift=cfg.shift),
        Digits(images[test_idx], labels[test_idx]),
    )
