"""Class-folder image data as tar shards plus an index, read by offset under the engine's own
sampler (data.format=shards).

Opening 1.28 M JPEGs from many nodes of a shared file system (Lustre, NFS, GPFS) is a storm
of metadata requests; a few hundred large files are not. `write_shards` (make shards) packs
each split's files, in the folder index's order, into tars of about `shard_bytes` in
WebDataset's layout (`<class>/<stem>.<ext>` with its label as `<class>/<stem>.cls`), so other
tools read them too, then writes `index.json` last: per split the shards (name, bytes,
samples), and per sample its name, size, label and offset in its shard. A stopped run rerun
continues: a shard is written under a temporary name and renamed once whole, a shard already
there is kept when its members are those planned, and the index is removed first and written
last, so shards without an index are never read.

`ShardImages` reads a sample with one pread at its recorded offset: the same bytes as the
file in the folder, hence the same tensors, and the same fingerprint (the index's names,
sizes and labels, engine.vision.imagefolder). The engine's global sampler still picks every
sample, so data order, resume and world-size invariance hold as for the folder.

Why not WebDataset's random-access reader (`wids`): it is gone from webdataset 1.x (0.2.x
ships it); its ShardListDataset copies every shard into /tmp/_wids_cache unless told
otherwise, writes lock files beside the shards (read-only shared data refuses them) and
copies non-atomically (a stopped copy looks complete); and its IndexedTarSamples scans a
shard's headers on every open and holds about 590 bytes of Python objects per sample while it
is open (measured: 10,000 samples, 0.48 s, 5.9 MB). Under a global random order every worker
touches every shard within a few batches, so each would either hold all of ImageNet's index
(~750 MB a worker) or rescan a shard per sample. The index here is numpy arrays (20 bytes a
sample), shared by forked workers."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.atomic import atomic_write_text
from engine.data.errors import BadSample, DataError
from engine.vision.imagefolder import FolderHelp, FolderIndex, ImageFiles, folder_indexes
from engine.vision.images import IMAGENET_MEAN, IMAGENET_STD

INDEX_NAME = "index.json"
INDEX_FORMAT = 1
SPLITS = ("train", "val")
PARTIAL = ".partial"  # a shard being written: never read, removed by the next run


# ---------------------------------------------------------------- the index


@dataclass(frozen=True)
class ShardSplit:
    """One split of a shard index: its shards and, per sample, name, size, label, offset."""

    folder: str  # the folder of the shards
    classes: list[str]
    files: list[str]  # "class/name" as in the folder, in the folder index's order
    labels: list[int]
    sizes: list[int]  # bytes of each image
    offsets: list[int]  # where each image's bytes start in its shard
    shards: list[tuple[str, int, int]]  # (file name, bytes, samples), in order

    def folder_index(self) -> FolderIndex:
        return FolderIndex(self.folder, self.classes, self.files, self.labels, self.sizes)


def index_path(folder: Path) -> Path:
    return Path(folder) / INDEX_NAME


def read_index(folder: Path, command: str) -> dict:
    """The shard index at folder, or a one-line DataError saying how to write it."""
    path = index_path(folder)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(
            f"no shard index at {path}: write the shards with `{command}` "
            "(from the class folders at data.root), or set data.shards to where they are"
        ) from None
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read the shard index {path} ({err}): rerun `{command}`") from None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
        raise DataError(f"{path} is not a shard index of format {INDEX_FORMAT}: rerun `{command}`")
    return doc


def split_of(doc: dict, folder: Path, split: str) -> ShardSplit:
    part = doc["splits"][split]
    classes = doc["classes"]
    files = [f"{c}/{n}" for c, names in zip(classes, part["names"], strict=True) for n in names]
    labels = [k for k, names in enumerate(part["names"]) for _ in names]
    sizes = [s for per_class in part["sizes"] for s in per_class]
    shards = [tuple(s) for s in part["shards"]]
    return ShardSplit(str(folder), classes, files, labels, sizes, part["offsets"], shards)


def check_shards(split: ShardSplit, command: str) -> None:
    """Every shard is there, readable and of the size the index says (a stat and an open
    each, no read)."""
    for name, size, _ in split.shards:
        path = os.path.join(split.folder, name)
        try:
            found = os.stat(path).st_size
            with open(path, "rb"):
                pass
        except OSError as err:
            raise DataError(
                f"cannot read shard {path} ({err.strerror}): restore it, or rerun `{command}` "
                "to write the missing shards"
            ) from None
        if found != size:
            raise DataError(
                f"shard {path} is {found} bytes, the index says {size} (truncated or "
                f"overwritten): rerun `{command}`, which rewrites it"
            )


# ---------------------------------------------------------------- reading


class ShardImages(ImageFiles):
    """ImageFiles whose bytes come from shards: sample i is one pread of its size at its
    offset in its shard. Each process opens a shard once, when it first reads from it, and
    keeps it open (a handful of large files, not one open per image). `command` is what the
    errors name to write the shards again."""

    def __init__(
        self,
        split: ShardSplit,
        transform=None,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        command: str = "make shards",
    ):
        super().__init__(split.folder_index(), transform, mean, std)
        self.command = command
        self.shard_paths = [os.path.join(split.folder, name) for name, _, _ in split.shards]
        self.shard_sizes = [size for _, size, _ in split.shards]
        counts = [n for _, _, n in split.shards]
        self.shard_of = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        self.offsets = np.array(split.offsets, dtype=np.int64)
        self._open: dict[int, int] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}  # descriptors stay with their process

    def __del__(self) -> None:
        for fd in getattr(self, "_open", {}).values():  # this process's own (forked: copies)
            os.close(fd)

    def path(self, i: int) -> str:
        """The sample as errors name it: its shard and its file in the folder."""
        return f"{self.shard_paths[self.shard_of[i]]} ({os.fsdecode(self.files[i])})"

    def read(self, i: int) -> torch.Tensor:
        size, offset = int(self.sizes[i]), int(self.offsets[i])
        data = torch.empty(size, dtype=torch.uint8)
        try:
            got = os.preadv(self._shard(int(self.shard_of[i])), [memoryview(data.numpy())], offset)
        except OSError as err:
            raise BadSample(self.path(i), err.strerror or str(err)) from None
        if got != size:
            raise BadSample(self.path(i), f"read {got} of its {size} bytes")
        return data

    def _shard(self, k: int) -> int:
        fd = self._open.get(k)
        if fd is None:
            path = self.shard_paths[k]
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as err:
                raise DataError(
                    f"cannot read shard {path} ({err.strerror}): restore it, or rerun "
                    f"`{self.command}` to write it"
                ) from None
            if os.fstat(fd).st_size != self.shard_sizes[k]:
                os.close(fd)
                raise DataError(
                    f"shard {path} is not the {self.shard_sizes[k]} bytes the index says "
                    f"(truncated or overwritten): rerun `{self.command}`, which rewrites it"
                )
            self._open[k] = fd
        return fd

    def fingerprint(self, content: bool = False) -> dict:
        """The folder's fingerprint of the same samples (their names, sizes and labels; with
        content=True their bytes, read from the shards): shards written from a folder
        fingerprint as that folder does, so a run may move between the two."""
        digests = None
        if content:
            digests = [hashlib.sha256(self.read(i).numpy()).hexdigest() for i in range(len(self))]
        fp = self._fingerprint(content, digests)
        count = len(self.shard_paths)
        fp["summary"] += f" in {count} shard{'s' if count > 1 else ''}"
        return fp


# ---------------------------------------------------------------- a node's local copies


def cached_copies(split: ShardSplit, cache_dir: Path, index_file: Path) -> ShardSplit:
    """The split read from node-local copies under cache_dir/<index hash>/: each shard copied
    once per node (the first process to take its lock copies it to a temporary name and
    renames it whole; the others find it there), then read locally. Named by the index's
    hash, so shards rewritten by make shards are never confused with older copies."""
    key = hashlib.sha256(index_file.read_bytes()).hexdigest()[:16]
    local = Path(cache_dir) / key
    try:
        local.mkdir(parents=True, exist_ok=True)
        copied = [_copy_once(split.folder, local, name, size) for name, size, _ in split.shards]
    except OSError as err:
        raise DataError(
            f"cannot copy the shards to data.shard_cache={cache_dir} ({err}): give a writable "
            "node-local folder with room for them, or leave data.shard_cache empty"
        ) from None
    if any(copied):
        moved = sum(size for (_, size, _), c in zip(split.shards, copied, strict=True) if c)
        print(f"copied {sum(copied)} shards ({moved / 1e9:.2f} GB) to {local}", file=sys.stderr)
    return dataclasses.replace(split, folder=str(local))


def _copy_once(source: str, local: Path, name: str, size: int) -> bool:
    """True when this process copied the shard, False when a whole copy was there."""
    target = local / name
    with open(local / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one copier per node; the others wait for it
        if target.exists() and target.stat().st_size == size:
            return False
        tmp = local / f".{name}.{os.getpid()}{PARTIAL}"
        try:
            shutil.copyfile(os.path.join(source, name), tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return True


def load_split(folder: Path, split: str, command: str, cache_dir: str = "") -> ShardSplit:
    """One split of the shards at folder (checked), or of their node-local copies."""
    doc = read_index(folder, command)
    try:
        part = split_of(doc, Path(folder).resolve(), split)
    except (KeyError, TypeError, ValueError) as err:  # written by another program, or edited
        raise DataError(
            f"{index_path(folder)} does not describe the {split} split ({err!r}): rerun `{command}`"
        ) from None
    check_shards(part, command)
    return cached_copies(part, Path(cache_dir), index_path(folder)) if cache_dir else part


# ---------------------------------------------------------------- writing (make shards)


@dataclass(frozen=True)
class Planned:
    """One shard to write: its file name and the slice of the split's samples it holds."""

    name: str
    start: int
    stop: int


def plan(split: str, sizes: list[int], shard_bytes: int) -> list[Planned]:
    """Consecutive samples (in the index's order) cut into shards of at least shard_bytes of
    images, the last one smaller: the same plan for the same folder, run after run."""
    shards, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= shard_bytes or i == len(sizes) - 1:
            shards.append(Planned(f"{split}-{len(shards):06d}.tar", start, i + 1))
            start, total = i + 1, 0
    return shards


def member_names(file: str) -> tuple[str, str]:
    """WebDataset's names for a sample: `<class>/<stem>.<ext>` and `<class>/<stem>.cls` (a
    key holds no dot, so dots in a stem become underscores)."""
    folder, name = file.split("/", 1)
    stem, ext = os.path.splitext(name)
    key = f"{folder}/{stem.replace('.', '_')}"
    return f"{key}.{ext.lstrip('.').lower() or 'bin'}", f"{key}.cls"


def _members(index: FolderIndex, shard: Planned) -> list[tuple[str, int]]:
    """(name, size) of each tar member the shard must hold, in order."""
    out = []
    for i in range(shard.start, shard.stop):
        image, label = member_names(index.files[i])
        out += [(image, index.sizes[i]), (label, len(str(index.labels[i])))]
    return out


def _existing(path: Path, members: list[tuple[str, int]]) -> tuple[int, list[int]] | None:
    """(bytes, image offsets) of a whole shard already at path holding exactly these members;
    None for anything else (absent, truncated, other members): it is then rewritten."""
    try:
        with tarfile.open(path, "r:") as tar:
            found = [(m.name, m.size, m.offset_data) for m in tar]
    except (OSError, tarfile.TarError, EOFError):
        return None
    if [(name, size) for name, size, _ in found] != members:
        return None
    last_end = found[-1][2] + found[-1][1] if found else 0
    if path.stat().st_size < last_end:
        return None
    return path.stat().st_size, [offset for _, _, offset in found[::2]]


def _tar_entry(name: str, size: int) -> tarfile.TarInfo:
    """A member with fixed metadata: the same folder gives the same shards, byte for byte."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0
    return info


def _entry(index: FolderIndex, i: int, name: str, size: int) -> tarfile.TarInfo:
    """The image's member; a name over USTAR's 255 bytes is refused in one line."""
    info = _tar_entry(name, size)
    try:
        info.tobuf(tarfile.USTAR_FORMAT)
    except ValueError:
        raise DataError(
            f"{index.root}/{index.files[i]}: its name is too long for a tar shard (at most "
            "255 bytes, a class folder included): shorten it"
        ) from None
    return info


class _Bytes:
    """A file object over bytes for tarfile.addfile, without a copy into BytesIO."""

    def __init__(self, data: bytes):
        self.view, self.at = memoryview(data), 0

    def read(self, n: int = -1) -> bytes:
        n = len(self.view) - self.at if n < 0 else n
        chunk = self.view[self.at : self.at + n]
        self.at += len(chunk)
        return chunk


def _read_source(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise DataError(
            f"cannot read {path} ({err.strerror}) while writing shards: fix or delete the "
            "file, then rerun (the shards written so far are kept)"
        ) from None


def write_shard(index: FolderIndex, shard: Planned, out: Path) -> tuple[int, list[int]]:
    """The shard written to a temporary name, synced, then renamed whole; (bytes, offsets)."""
    tmp = out / f".{shard.name}.{os.getpid()}{PARTIAL}"
    offsets: list[int] = []
    try:
        with open(tmp, "wb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(shard.start, shard.stop):
                    data = _read_source(os.path.join(index.root, index.files[i]))
                    image, label = member_names(index.files[i])
                    offsets.append(tar.offset + tarfile.BLOCKSIZE)  # a USTAR header: one block
                    tar.addfile(_entry(index, i, image, len(data)), _Bytes(data))
                    text = str(index.labels[i]).encode()
                    tar.addfile(_tar_entry(label, len(text)), _Bytes(text))
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, out / shard.name)
    finally:
        tmp.unlink(missing_ok=True)
    return size, offsets


def _split_doc(index: FolderIndex, written: list[tuple[Planned, int, list[int]]]) -> dict:
    names: list[list[str]] = [[] for _ in index.classes]
    sizes: list[list[int]] = [[] for _ in index.classes]
    for file, label, size in zip(index.files, index.labels, index.sizes, strict=True):
        names[label].append(file.split("/", 1)[1])
        sizes[label].append(size)
    return {
        "shards": [[s.name, size, s.stop - s.start] for s, size, _ in written],
        "names": names,
        "sizes": sizes,
        "offsets": [offset for _, _, offsets in written for offset in offsets],
    }


class Progress:
    """One line per shard: where the writing is, and how long the rest should take."""

    def __init__(self, total_bytes: int, total_shards: int):
        self.total, self.shards, self.done, self.count = total_bytes, total_shards, 0, 0
        self.started = time.monotonic()

    def shard(self, path: Path, images: int, image_bytes: int, kept: bool) -> None:
        self.done, self.count = self.done + image_bytes, self.count + 1
        elapsed = time.monotonic() - self.started
        left = elapsed / max(self.done, 1) * (self.total - self.done)
        what = "kept (written before)" if kept else "written"
        print(
            f"shard {self.count}/{self.shards} {path.name}: {images} images "
            f"({image_bytes / 1e6:.1f} MB) {what}; {elapsed:.0f} s so far, about {left:.0f} s left",
            flush=True,
        )


def write_split(index: FolderIndex, split: str, out: Path, shard_bytes: int, progress) -> dict:
    written = []
    for shard in plan(split, index.sizes, shard_bytes):
        have = _existing(out / shard.name, _members(index, shard))
        size, offsets = have or write_shard(index, shard, out)
        images = sum(index.sizes[shard.start : shard.stop])
        progress.shard(out / shard.name, shard.stop - shard.start, images, kept=have is not None)
        written.append((shard, size, offsets))
    return _split_doc(index, written)


def _check_keys(index: FolderIndex) -> None:
    """Two files whose WebDataset keys agree (a.b.jpg and a_b.jpg) would be one sample to
    other readers of the shards."""
    seen: dict[str, str] = {}
    for file in index.files:
        key = member_names(file)[1]
        if key in seen:
            raise DataError(
                f"{index.root}/{seen[key]} and {index.root}/{file} make the same shard key "
                f"{key[:-4]}: rename one of them"
            )
        seen[key] = file


def write_shards(
    root: Path, out: Path, shard_bytes: int, help_text: FolderHelp, cache_dir: Path | None = None
) -> Path:
    """make shards: the class folders at root as shards and their index in out; returns the
    index's path. Rerun after a stop, it keeps the whole shards already written."""
    train, val = folder_indexes(root, cache_dir, help_text)
    for index in (train, val):
        _check_keys(index)
    out.mkdir(parents=True, exist_ok=True)
    index_path(out).unlink(missing_ok=True)  # shards being rewritten are never read as done
    for stale in out.glob(f".*{PARTIAL}"):  # what a stopped run was writing
        stale.unlink()
    indexes = dict(zip(SPLITS, (train, val), strict=True))
    shards = sum(len(plan(s, i.sizes, shard_bytes)) for s, i in indexes.items())
    progress = Progress(sum(train.sizes) + sum(val.sizes), shards)
    print(f"writing {len(train)} + {len(val)} images from {root} as {shards} shards in {out}")
    splits = {s: write_split(i, s, out, shard_bytes, progress) for s, i in indexes.items()}
    doc = {"format": INDEX_FORMAT, "source": str(Path(root).resolve()), "classes": train.classes}
    atomic_write_text(index_path(out), json.dumps(doc | {"splits": splits}, separators=(",", ":")))
    elapsed = time.monotonic() - progress.started
    print(f"wrote {index_path(out)} ({len(train) + len(val)} images) in {elapsed:.1f} s")
    return index_path(out)
