"""Bytes of text as next-byte prediction samples.

The default corpus is the text of Python's own documentation that ships with every CPython
(`pydoc_data.topics`, what `help()` shows): about 465 KB of English prose and code, offline.
`data.path` names any other file, read as raw bytes. The first (1 - eval_fraction) of the
bytes train, the rest evaluate. Samples are non-overlapping blocks, so an epoch is one pass
over the training text and evaluation predicts each held-out byte once (less a tail shorter
than one block)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from engine.config import ConfigError, bounded


@dataclass
class DataConfig:
    path: str = ""  # a file of text (any bytes); "": Python's documentation (pydoc_data)
    block_size: int = bounded(64, ge=1)  # tokens (bytes) per sample; <= model.context
    eval_fraction: float = bounded(0.1, gt=0, lt=1)  # the end of the text, held out


class ByteBlocks(Dataset):
    """Sample i: x = data[i*T : (i+1)*T], y = data[i*T+1 : (i+1)*T+1], both int64."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size  # the last target needs one byte more

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def default_corpus() -> bytes:
    """Python's documentation topics, in sorted key order, as UTF-8."""
    from pydoc_data.topics import topics  # start-up time: a large module, only by default

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


def read_bytes(path: str) -> bytes:
    if not path:
        return default_corpus()
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ConfigError(
            f"data.path={path!r} cannot be read ({e.strerror or type(e).__name__}): "
            "name a readable text file, or leave data.path empty for the built-in corpus"
        ) from None


def check_data(cfg: DataConfig) -> None:
    """data.path names a readable file (or is empty: the built-in corpus)."""
    path = Path(cfg.path).expanduser()
    if cfg.path and not (path.is_file() and os.access(path, os.R_OK)):
        raise ConfigError(
            f"data.path={cfg.path!r} is not a readable file: name a text file, or leave "
            "data.path empty for the built-in corpus"
        )


def split(data: torch.Tensor, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    cut = round(len(data) * (1 - eval_fraction))
    return data[:cut], data[cut:]


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    raw = read_bytes(cfg.path)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0).byte()
    train, held_out = split(data, cfg.eval_fraction)
    for what, part in (("training", train), ("evaluation", held_out)):
        if len(part) < cfg.block_size + 1:
            raise ConfigError(
                f"the {what} text has {len(part)} bytes, fewer than one block of "
                f"data.block_size={cfg.block_size} plus one: use a longer text (data.path), "
                "a smaller data.block_size, or a different data.eval_fraction"
            )
    return ByteBlocks(train, cfg.block_size), ByteBlocks(held_out, cfg.block_size)
