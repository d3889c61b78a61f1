"""Bytes of text as next-byte prediction samples.

The default corpus is the text of Python's own documentation that ships with every CPython
(`pydoc_data.topics`, what `help()` shows): about 465 KB of English prose and code, offline.
`data.path` names any other file, read as raw bytes. The first (1 - eval_fraction) of the
bytes train, the rest evaluate. Samples are non-overlapping blocks, so an epoch is one pass
over the training text and evaluation predicts each held-out byte once (less a tail shorter
than one block).

A file at data.path is never read into memory: its tokens (one uint8 per byte) are written
once to a token file in a cache folder (`.token-cache/` beside it when that is writable, else
~/.cache/recipes/tokens), named by the source's path, size and mtime and written atomically,
with its sha256 beside it; every process maps that file read-only (a numpy array over an
mmap, advised random access) and a sample copies its block out of the map. A process's resident memory then grows with the
blocks it reads, not the corpus, and the samples are those of the corpus read into memory,
bit for bit. The built-in corpus (465 KB) stays in memory."""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from engine.config import ConfigError, bounded


@dataclass
class DataConfig:
    path: str = ""  # a file of text (any bytes); "": Python's documentation (pydoc_data)
    block_size: int = bounded(64, ge=1)  # tokens (bytes) per sample; <= model.context
    eval_fraction: float = bounded(0.1, gt=0, lt=1)  # the end of the text, held out


TOKEN_FORMAT = 1  # the token cache's meta file
CHUNK = 1 << 20  # bytes copied at a time into the token file


class TokenFile:
    """Tokens [start, stop) of a token file (uint8), read-only, mapped by each process on its
    first read: a loader worker started by spawn gets the path, never a copy of the map.
    Sliced, it returns the tokens as an int64 tensor (a copy of just that slice).

    The map is advised random access (MADV_RANDOM): no readahead, so a read brings in and
    maps the pages it needs, not the megabytes around them (samples are drawn in random
    order anyway)."""

    def __init__(self, path: str, start: int, stop: int):
        self.path, self.start, self.stop = path, start, stop
        self._map: mmap.mmap | None = None
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def tokens(self) -> np.ndarray:
        """The whole token file as a read-only uint8 array over the map."""
        if self._tokens is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(self._map, "madvise"):  # Linux, macOS
                self._map.madvise(mmap.MADV_RANDOM)
            self._tokens = np.frombuffer(self._map, dtype=np.uint8)
        return self._tokens

    def __getitem__(self, part: slice) -> torch.Tensor:
        a, b, _ = part.indices(len(self))
        chunk = self.tokens()[self.start + a : self.start + max(a, b)]
        return torch.from_numpy(chunk.astype(np.int64))

    def __getstate__(self) -> dict:
        return vars(self) | {"_map": None, "_tokens": None}


class ByteBlocks(Dataset):
    """Sample i: x = data[i*T : (i+1)*T], y = data[i*T+1 : (i+1)*T+1], both int64. `data`: a
    uint8 tensor (in memory) or a TokenFile (mapped); `source`: (the corpus's sha256, the
    part's first and last byte + 1), which names the data in its fingerprint."""

    def __init__(
        self,
        data: torch.Tensor | TokenFile,
        block_size: int,
        source: tuple[str, int, int] | None = None,
    ):
        self.data, self.block_size = data, block_size
        if source is None:  # in memory: hash its bytes
            raw = data.contiguous().numpy().tobytes() if isinstance(data, torch.Tensor) else b""
            source = (hashlib.sha256(raw).hexdigest(), 0, len(data))
        self.source = source

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size  # the last target needs one byte more

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]

    def fingerprint(self, content: bool = False) -> dict:
        """The corpus's sha256 and the part of it this split holds (no byte is read: the
        token file's hash was taken as it was written)."""
        sha, start, stop = self.source
        n = stop - start
        return {
            "method": "bytes",
            "sha256": hashlib.sha256(f"{sha}:{start}:{stop}".encode()).hexdigest(),
            "count": n,
            "unit": "bytes",
            "summary": f"{n} bytes ({len(self)} blocks of {self.block_size})",
        }


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


def count_samples(cfg: DataConfig) -> int | None:
    """The training set's blocks, from the text's size alone (a byte is a token): what a
    check before the queue compares with the batch. None where the file is not visible here
    (a data.path only the compute nodes mount)."""
    if cfg.path:
        try:
            size = Path(cfg.path).expanduser().stat().st_size
        except OSError:
            return None
    else:
        size = len(default_corpus())
    return max(cut_at(size, cfg.eval_fraction) - 1, 0) // cfg.block_size


def split(data: torch.Tensor, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    cut = cut_at(len(data), eval_fraction)
    return data[:cut], data[cut:]


def cut_at(size: int, eval_fraction: float) -> int:
    """Where the held-out end of a text of `size` bytes begins."""
    return round(size * (1 - eval_fraction))


# ---------------------------------------------------------------- the token file


def token_cache_dir(source: Path) -> Path:
    """Beside the data when that is writable, else the user's own cache folder."""
    if os.access(source.parent, os.W_OK):
        return source.parent / ".token-cache"
    return Path.home() / ".cache" / "recipes" / "tokens"


def _read_meta(meta: Path) -> dict | None:
    try:
        doc = json.loads(meta.read_text())
        return doc if isinstance(doc, dict) and doc.get("format") == TOKEN_FORMAT else None
    except (OSError, ValueError):
        return None


def token_file(path: str, cache_dir: Path | None = None) -> tuple[Path, dict]:
    """The tokens of the text at `path` in a token file, written once: (its path, its meta:
    the source's path, size, mtime and sha256). The name holds the source's path, size and
    mtime, so an edited source gets a new file (the old one is removed). The copy streams
    through one buffer: writing it holds no more of the corpus in memory than reading it."""
    try:
        source = Path(path).expanduser().resolve()
        st = source.stat()
    except OSError as e:
        raise ConfigError(
            f"data.path={path!r} cannot be read ({e.strerror or type(e).__name__}): "
            "name a readable text file, or leave data.path empty for the built-in corpus"
        ) from None
    folder = Path(cache_dir or token_cache_dir(source))
    key = hashlib.sha256(f"{source}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    tokens = folder / f"{source.name}-{key}.u8"
    meta_path = tokens.with_suffix(".json")
    meta = _read_meta(meta_path)
    if meta is not None and tokens.is_file() and tokens.stat().st_size == meta["size"]:
        return tokens, meta
    try:
        folder.mkdir(parents=True, exist_ok=True)
        digest = _write_tokens(source, tokens)
    except OSError as e:
        raise ConfigError(
            f"cannot write the token file of data.path={path!r} in {folder} "
            f"({e.strerror or type(e).__name__}): make that folder writable"
        ) from None
    meta = {
        "format": TOKEN_FORMAT,
        "source": str(source),
        "size": tokens.stat().st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": digest,
    }
    _atomic_text(meta_path, json.dumps(meta) + "\n")  # last: its presence vouches for the tokens
    _remove_stale(folder, source, tokens)
    return tokens, meta


def _write_tokens(source: Path, tokens: Path) -> str:
    """Byte-level tokens are the bytes themselves: copied in chunks, hashed on the way."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    fd, tmp = tempfile.mkstemp(dir=tokens.parent, prefix=tokens.name, suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with open(source, "rb") as src, os.fdopen(fd, "wb") as out:
            while n := src.readinto(buffer):
                digest.update(view[:n])
                out.write(view[:n])
            out.flush()
            os.fsync(out.fileno())
            # Written pages sit in the page cache in large blocks, which a fault would map
            # whole into every reader; dropped, the readers bring in the pages they read.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, tokens)  # atomic: another process never maps a half-written file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def _atomic_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _remove_stale(folder: Path, source: Path, keep: Path) -> None:
    """Token files of an earlier version of the same source (another size or mtime)."""
    for meta_path in folder.glob(f"{source.name}-*.json"):
        tokens = meta_path.with_suffix(".u8")
        if tokens == keep or (_read_meta(meta_path) or {}).get("source") != str(source):
            continue
        for stale in (meta_path, tokens):
            with contextlib.suppress(OSError):
                stale.unlink()


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    if cfg.path:
        tokens, meta = token_file(cfg.path)
        size, sha = meta["size"], meta["sha256"]

        def part(a: int, b: int):
            return TokenFile(str(tokens), a, b)

    else:
        raw = default_corpus()
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        size, sha = len(data), hashlib.sha256(raw).hexdigest()

        def part(a: int, b: int):
            return data[a:b]

    cut = cut_at(size, cfg.eval_fraction)
    for what, n in (("training", cut), ("evaluation", size - cut)):
        if n < cfg.block_size + 1:
            raise ConfigError(
                f"the {what} text has {n} bytes, fewer than one block of "
                f"data.block_size={cfg.block_size} plus one: use a longer text (data.path), "
                "a smaller data.block_size, or a different data.eval_fraction"
            )
    return (
        ByteBlocks(part(0, cut), cfg.block_size, (sha, 0, cut)),
        ByteBlocks(part(cut, size), cfg.block_size, (sha, cut, size)),
    )
