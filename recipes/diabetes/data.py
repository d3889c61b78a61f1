"""scikit-learn's diabetes data (442 patients, 10 features, a continuous target; no download).

The held-out split is fixed by its own seed (data.split_seed), never the training seed, so
every run is evaluated on the same patients. Features and target are standardised with the
mean and standard deviation of the training split alone: nothing of the held-out set leaks
into training."""

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from engine.config import ConfigError, bounded

FEATURES = 10  # the data's columns: age, sex, bmi, bp, s1-s6 (load_arrays checks it)


@dataclass
class DataConfig:
    test_fraction: float = bounded(0.2, gt=0, lt=1)
    split_seed: int = bounded(20240611, ge=0, lt=2**64)  # the held-out split's own seed


class Table(Dataset):
    """Rows of standardised features, [10] each, and their standardised target, [1]."""

    def __init__(self, features: torch.Tensor, targets: torch.Tensor):
        self.features, self.targets = features, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.features[i], self.targets[i]


def diabetes_table() -> tuple[np.ndarray, np.ndarray]:
    """(442 x 10 raw features, 442 targets): the two files scikit-learn ships, read directly and
    unscaled, as its load_diabetes(scaled=False) does (its default scaling uses all 442 rows,
    the held-out ones included); importing sklearn.datasets would add seconds to every start.
    Without scikit-learn, a one-line error that names it."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "recipe diabetes reads the diabetes data that scikit-learn ships, and scikit-learn "
            "is not installed: pip install scikit-learn (the project's requirements.lock has it)"
        )
    folder = Path(spec.submodule_search_locations[0]) / "datasets" / "data"
    features, targets = folder / "diabetes_data_raw.csv.gz", folder / "diabetes_target.csv.gz"
    if not (features.exists() and targets.exists()):  # another scikit-learn layout
        from sklearn.datasets import load_diabetes  # start-up time: seconds, rarely needed

        return load_diabetes(return_X_y=True, scaled=False)
    return np.loadtxt(features), np.loadtxt(targets)


def load_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    features, targets = diabetes_table()
    assert features.shape[1] == FEATURES, features.shape
    x = torch.tensor(features, dtype=torch.float32)
    return x, torch.tensor(targets, dtype=torch.float32).unsqueeze(1)


def split(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random split with its own seed: the same held-out rows for every run."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(n * test_fraction)
    if n_test < 1 or n - n_test < 2:
        raise ConfigError(
            f"data.test_fraction={test_fraction} leaves {n_test} held-out and {n - n_test} "
            f"training rows of {n}: each split needs some (training: 2, for a std)"
        )
    return order[n_test:].sort().values, order[:n_test].sort().values


def standardise(train: torch.Tensor, held_out: torch.Tensor):
    """Both scaled by the training rows' mean and standard deviation, per column."""
    mean, std = train.mean(0), train.std(0)
    return (train - mean) / std, (held_out - mean) / std


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    x, y = load_arrays()
    train_idx, test_idx = split(len(y), cfg.test_fraction, cfg.split_seed)
    x_train, x_test = standardise(x[train_idx], x[test_idx])
    y_train, y_test = standardise(y[train_idx], y[test_idx])
    return Table(x_train, y_train), Table(x_test, y_test)
