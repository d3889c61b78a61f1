"""Loaders around a recipe's datasets. Recipes return datasets; the engine owns order,
sharding, workers, seeding and what happens to a file that cannot be read."""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from engine import recipe as contract
from engine.config import LoaderConfig
from engine.data.device import DeviceData, DeviceLoader
from engine.data.errors import BadSample, DataError
from engine.data.sampler import GlobalBatchSampler, Keys, Sample, eval_batches, eval_shard
from engine.data.stages import worker_batch_seconds
from engine.seeding import derive_seed, seed_sample, worker_init

MAX_REPLACEMENTS = 16  # consecutive unreadable files before a run gives up even with skip_bad


class SeededSamples(Dataset):
    """Takes (index, sample seed, epoch) keys; returns Samples (a batch of them for the
    training sampler's Keys).

    Seeding per sample makes augmentation independent of which worker loads it. In the main
    process (num_workers=0) torch's RNG state is restored afterwards, so model-side randomness
    (dropout) is the same whatever the number of workers. With python_numpy, python's and
    numpy's global RNGs are seeded per sample too and left so: the loop does not draw from
    them, and restoring numpy's state would cost more than loading the sample.

    A file that cannot be decoded (BadSample) stops the run with its path, or with skip_bad is
    replaced by the next readable sample (index + 1, + 2, ...) loaded with the same seed: a
    deterministic replacement, so resume and world-size invariance still hold.

    A dataset that loads whole batches (whole_batches: a TensorDataset, or `load_batch`)
    is indexed once per training batch: it draws no randomness, so nothing is seeded."""

    def __init__(self, dataset: Dataset, python_numpy: bool = False, skip_bad: bool = False):
        self.dataset = dataset
        self.python_numpy = python_numpy
        self.skip_bad = skip_bad
        self.warned: set[str] = set()
        self.whole = whole_batches(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def _read(self, index: int, sample_seed: int):
        seed_sample(sample_seed, self.python_numpy)
        return self.dataset[index]

    def _load(self, index: int, sample_seed: int) -> Sample:
        try:
            return Sample(*self._read(index, sample_seed), index, 0)
        except BadSample as bad:
            if not self.skip_bad:
                raise DataError(
                    f"unreadable sample {bad}; replace or delete the file, or set "
                    "data.skip_bad=true to skip such files (they are counted)"
                ) from None
            self._warn(bad)
        for k in range(1, MAX_REPLACEMENTS + 1):
            try:
                x, y = self._read((index + k) % len(self.dataset), sample_seed)
                return Sample(x, y, index, 1)
            except BadSample as bad:
                self._warn(bad)
        raise DataError(
            f"{MAX_REPLACEMENTS + 1} unreadable files in a row after sample {index}; "
            "the dataset looks damaged: check it before training"
        )

    def _warn(self, bad: BadSample) -> None:
        if bad.path not in self.warned:
            self.warned.add(bad.path)
            print(f"warning: skipping unreadable {bad} (data.skip_bad)", file=sys.stderr)

    def __getitem__(self, key: tuple[int, int, int]) -> Sample:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Keys | list[tuple[int, int, int]]) -> Sample | list[Sample]:
        """A whole micro batch at once (the DataLoader calls this when it exists). The
        training sampler's Keys come back as one collated batch (collate passes it through);
        a list of keys (evaluation) as a list of Samples, for the collate. The caller's RNG
        state is saved and restored once per batch, not once per sample, and not at all for
        a dataset that loads whole batches (it draws nothing)."""
        if isinstance(keys, Keys) and self.whole is not None:
            return self._whole_batch(keys)
        if torch.utils.data.get_worker_info() is not None:
            return self._load_batch(keys)
        saved = torch.default_generator.get_state()
        try:
            return self._load_batch(keys)
        finally:
            torch.default_generator.set_state(saved)

    def _set_epoch(self, epoch: int) -> None:
        set_epoch = contract.epoch_hook(self.dataset)  # e.g. progressive resizing
        if set_epoch is not None:
            set_epoch(epoch)

    def _whole_batch(self, keys: Keys) -> Sample:
        """One indexing op for the batch: no per-sample seeding, record or collate."""
        self._set_epoch(keys.epoch)
        x, y = self.whole(keys.index)
        return Sample(x, y, keys.index, torch.zeros(len(keys), dtype=torch.long))

    def _load_batch(self, keys: Keys | list[tuple[int, int, int]]) -> Sample | list[Sample]:
        if not isinstance(keys, Keys):
            self._set_epoch(keys[0][2])  # the keys of a batch share their epoch
            return [self._load(index, sample_seed) for index, sample_seed, _ in keys]
        self._set_epoch(keys.epoch)
        xs, ys, replaced = [], [], []
        for index, sample_seed in zip(keys.index.tolist(), keys.seeds(), strict=True):
            sample = self._load(index, sample_seed)
            xs.append(sample.x)
            ys.append(sample.y)
            replaced.append(sample.replaced)
        # as default_collate of the Samples would make it, field by field
        replaced = torch.tensor(replaced, dtype=torch.long)
        return Sample(
            collate_x(xs), default_collate(ys), keys.index, replaced, worker_batch_seconds()
        )


def whole_batches(dataset: Dataset):
    """The dataset's loader of whole batches, index tensor -> (x, y), where it has one: a
    TensorDataset of (x, y), or a dataset's own `load_batch(index)`, which declares that it
    returns default_collate([dataset[i] for i in index]) bit for bit, draws no randomness
    and cannot meet an unreadable sample. None: samples are loaded (and seeded) one by one."""
    if type(dataset) is TensorDataset and len(dataset.tensors) == 2:
        tensors = dataset.tensors
        return lambda index: (tensors[0][index], tensors[1][index])
    return contract.batch_loader(dataset)


def collate_x(xs: list):
    """default_collate, or the x type's own `collate` (a batch the dataset finishes on the
    device, e.g. gpu_decode's EncodedImage)."""
    own = getattr(type(xs[0]), "collate", None)
    return default_collate(xs) if own is None else own(xs)


def collate(samples: list[Sample] | Sample) -> Sample:
    """default_collate field by field (as it collates a NamedTuple), except for samples whose
    x type brings its own `collate`; a sample's `work` (None: evaluation's samples) is not
    collated. A batch loaded whole (training's Keys) passes through."""
    if isinstance(samples, Sample):
        return samples
    y, index, replaced = default_collate([(s.y, s.index, s.replaced) for s in samples])
    return Sample(collate_x([s.x for s in samples]), y, index, replaced)


def _worker_options(cfg: LoaderConfig, device: torch.device) -> dict:
    opts = {"num_workers": cfg.num_workers, "pin_memory": cfg.pin_memory and device.type == "cuda"}
    opts["collate_fn"] = collate
    if cfg.num_workers > 0:
        opts |= {
            "persistent_workers": cfg.persistent_workers,
            "prefetch_factor": cfg.prefetch_factor,
            "worker_init_fn": worker_init,
        }
    return opts


def train_loader(
    dataset: Dataset,
    sampler: GlobalBatchSampler,
    cfg: LoaderConfig,
    device: torch.device,
    skip_bad: bool = False,
):
    """Micro batches as Samples of tensors. A DeviceData dataset is gathered and augmented
    on the device itself; anything else goes through a DataLoader with workers."""
    if isinstance(dataset, DeviceData):
        return DeviceLoader(dataset.to(device), sampler, train=True)
    generator = torch.Generator().manual_seed(derive_seed(sampler.seed, sampler.rank, 0x10AD))
    return DataLoader(
        SeededSamples(dataset, cfg.seed_python_numpy, skip_bad),
        batch_sampler=sampler,
        generator=generator,
        **_worker_options(cfg, device),
    )


def eval_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    cfg: LoaderConfig,
    device: torch.device,
    skip_bad: bool = False,
):
    """This rank's contiguous shard, in order. With skip_bad an unreadable file arrives as a
    replaced sample, which evaluation leaves out of its sums (and counts)."""
    batches = eval_batches(eval_shard(len(dataset), rank, world_size), batch_size)
    if isinstance(dataset, DeviceData):
        return DeviceLoader(dataset.to(device), batches, train=False)
    opts = _worker_options(cfg, device) | {"persistent_workers": False}
    if cfg.num_workers == 0:
        opts.pop("persistent_workers")
    return DataLoader(SeededSamples(dataset, skip_bad=skip_bad), batch_sampler=batches, **opts)
