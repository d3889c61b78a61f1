"""The class-folder layout of image datasets, `<root>/train/<class>/*` and
`<root>/val/<class>/*` (classes are the sorted folder names): a cached index of the files,
the layout's one-line errors (worded with the recipe's own FolderHelp: what the data is,
where to get it, how to sort it), a dataset that decodes each file to a uint8 RGB tensor, and
its fingerprint (engine.data.fingerprint): by default the index's names, sizes and labels
(no file read), or the files' bytes, cached by each file's size and mtime.

Listing a million files takes from seconds (local disk) to minutes (network file systems), so
the index is cached as JSON and reused while the split's folders are unchanged: adding, removing
or renaming a file changes its class folder's mtime, adding or removing a class the split's.
The sizes are the files' at the scan: a file rewritten in place leaves its folder's mtime as
it was (the content fingerprint sees it; the index's does not)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from engine.data.errors import DataError
from engine.data.fingerprint import NAMES_LIMIT
from engine.data.stages import sample_stage
from engine.vision.codec import decode_rgb, read_bytes, require_decoder
from engine.vision.images import IMAGENET_MEAN, IMAGENET_STD, normalise_on_device

IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png", ".webp"}
CACHE_FORMAT = 2  # 2: the files' sizes (format 1 had names only: rescanned once)
CONTENT_FORMAT = 1  # the content fingerprint's cache of each file's sha256
# A folder changed less than this before the scan may change again within the same mtime tick
# (coarse on some file systems) without its mtime showing it; such an index is not cached.
SETTLE_NS = 2_000_000_000


@dataclass(frozen=True)
class FolderIndex:
    root: str  # the split folder, e.g. <data root>/train
    classes: list[str]  # sorted class folder names
    files: list[str]  # "class/name", relative to root, sorted by (class, name)
    labels: list[int]  # class index per file
    sizes: list[int] = field(default_factory=list)  # bytes per file, at the scan
    cache_dir: str = field(default="", compare=False)  # where its caches live; "": default

    def __len__(self) -> int:
        return len(self.files)


def _class_names(split_dir: Path) -> list[str]:
    with os.scandir(split_dir) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def _images(class_dir: Path) -> tuple[list[str], list[int]]:
    """The image files' sorted names and their sizes (a stat each; no file is read)."""
    with os.scandir(class_dir) as entries:
        found = sorted(
            (e.name, e.stat().st_size)
            for e in entries
            if not e.name.startswith(".")
            and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES
            and e.is_file()
        )
    return [name for name, _ in found], [size for _, size in found]


def _index(
    root: str, classes: list[str], names: list[list[str]], sizes: list[list[int]]
) -> FolderIndex:
    files = [
        f"{cls}/{name}" for cls, per_class in zip(classes, names, strict=True) for name in per_class
    ]
    labels = [label for label, per_class in enumerate(names) for _ in per_class]
    return FolderIndex(root, classes, files, labels, [n for per in sizes for n in per])


def scan_split(split_dir: Path) -> FolderIndex:
    """Lists the split's image files (hidden files and other suffixes left out) with their
    sizes; no cache."""
    split_dir = Path(split_dir).resolve()
    classes = _class_names(split_dir)
    found = [_images(split_dir / c) for c in classes]
    return _index(str(split_dir), classes, [n for n, _ in found], [z for _, z in found])


def default_cache_dir(split_dir: Path) -> Path:
    """Beside the data when that is writable; data roots are often read-only (shared, mounted
    from a network store), and then the cache goes to the user's own cache folder."""
    data_root = Path(split_dir).resolve().parent
    if os.access(data_root, os.W_OK):
        return data_root / ".index-cache"
    return Path.home() / ".cache" / "recipes" / "index"


def _cache_file(split_dir: Path, cache_dir: Path) -> Path:
    key = hashlib.sha256(str(split_dir).encode()).hexdigest()[:16]
    return cache_dir / f"{split_dir.name}-{key}.json"


def _mtimes(split_dir: Path, classes: list[str]) -> tuple[int, list[int]]:
    return split_dir.stat().st_mtime_ns, [(split_dir / c).stat().st_mtime_ns for c in classes]


def _read_cache(path: Path, split_dir: Path) -> FolderIndex | None:
    """The cached index if it describes split_dir as it is now; None if absent, stale or
    unreadable (it is then rebuilt)."""
    try:
        doc = json.loads(path.read_text())
        if doc["format"] != CACHE_FORMAT or doc["root"] != str(split_dir):
            return None
        if [doc["split_mtime"], doc["class_mtimes"]] != list(_mtimes(split_dir, doc["classes"])):
            return None
        return _index(str(split_dir), doc["classes"], doc["names"], doc["sizes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


_warned_dirs: set[Path] = set()


def _write_cache(path: Path, index: FolderIndex, split_mtime: int, class_mtimes: list[int]):
    names: list[list[str]] = [[] for _ in index.classes]
    sizes: list[list[int]] = [[] for _ in index.classes]
    for file, label, size in zip(index.files, index.labels, index.sizes, strict=True):
        names[label].append(file.split("/", 1)[1])
        sizes[label].append(size)
    doc = {
        "format": CACHE_FORMAT,
        "root": index.root,
        "split_mtime": split_mtime,
        "classes": index.classes,
        "class_mtimes": class_mtimes,
        "names": names,
        "sizes": sizes,
    }
    _write_json(path, doc)


def _write_json(path: Path, doc: dict) -> None:
    """Atomically, readable by others sharing the data; a folder that refuses it is said once
    (every start then redoes the work)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from others sharing the data
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc, separators=(",", ":")))
            os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        if path.parent not in _warned_dirs:
            _warned_dirs.add(path.parent)
            warnings.warn(
                f"cannot write the file index cache in {path.parent} ({err}); every start "
                "rescans the data: pass a writable cache folder (data.index_cache)",
                stacklevel=3,
            )


def load_index(split_dir: Path, cache_dir: Path | None = None) -> FolderIndex:
    """scan_split's index, reused from <cache_dir>/<split>-<hash of its path>.json while the
    split's folders keep their mtimes. cache_dir None: default_cache_dir(split_dir)."""
    split_dir = Path(split_dir).resolve()
    cache_dir = Path(cache_dir or default_cache_dir(split_dir))
    cache_file = _cache_file(split_dir, cache_dir)
    index = _read_cache(cache_file, split_dir)
    if index is None:
        started = time.time_ns()
        index = scan_split(split_dir)
        # mtimes taken after the scan: if all are older than the scan, it saw the final state
        split_mtime, class_mtimes = _mtimes(split_dir, index.classes)
        if max(split_mtime, *class_mtimes) < started - SETTLE_NS:
            _write_cache(cache_file, index, split_mtime, class_mtimes)
    return dataclasses.replace(index, cache_dir=str(cache_dir))


# ---------------------------------------------------------------- the fingerprint


def content_digests(root: str, files: list[str], cache_dir: Path) -> list[str]:
    """Each file's sha256, read once: kept in <cache_dir>/<split>-<hash>.content.json with the
    file's size and mtime, and read again only when those change."""
    split_dir = Path(root)
    path = _cache_file(split_dir, cache_dir).with_suffix(".content.json")
    try:
        doc = json.loads(path.read_text())
        known = doc["files"] if doc["format"] == CONTENT_FORMAT and doc["root"] == root else {}
    except (OSError, ValueError, KeyError, TypeError):
        known = {}
    out, fresh, changed = [], {}, False
    for name in files:
        st = os.stat(split_dir / name)
        entry = known.get(name)
        if not (isinstance(entry, list) and entry[:2] == [st.st_size, st.st_mtime_ns]):
            digest = hashlib.sha256()
            with open(split_dir / name, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            entry, changed = [st.st_size, st.st_mtime_ns, digest.hexdigest()], True
        fresh[name] = entry
        out.append(entry[2])
    if changed or len(fresh) != len(known):
        _write_json(path, {"format": CONTENT_FORMAT, "root": root, "files": fresh})
    return out


def folder_fingerprint(
    root: str,
    classes: list[str],
    files: np.ndarray,
    sizes: np.ndarray,
    labels: np.ndarray,
    content: bool = False,
    cache_dir: Path | None = None,
    digests: list[str] | None = None,
) -> dict:
    """The split's index (names, sizes, labels: no file read) hashed class by class, or with
    content=True the files' bytes (engine.data.fingerprint's form, with the per-class parts
    and, for a small split, the names that let a refusal name the first difference). digests:
    each file's sha256 where the bytes are read elsewhere (shards), else from the files."""
    names = [os.fsdecode(f) for f in files.tolist()]
    bounds = np.searchsorted(labels, np.arange(len(classes) + 1))
    if content and digests is None:
        digests = content_digests(root, names, Path(cache_dir or default_cache_dir(Path(root))))
    elif not content:
        digests = None
    parts, index_parts, content_parts = {}, [], []
    for label, cls in enumerate(classes):
        a, b = int(bounds[label]), int(bounds[label + 1])
        h = hashlib.sha256("\0".join(names[a:b]).encode())
        h.update(np.asarray(sizes[a:b], dtype="<i8").tobytes())
        index_parts.append([cls, b - a, h.hexdigest()])
        if digests is not None:
            h.update("\0".join(digests[a:b]).encode())
            content_parts.append([cls, b - a, h.hexdigest()])
        parts[cls] = [b - a, h.hexdigest()[:16]]
    index_sha = hashlib.sha256(json.dumps(index_parts).encode()).hexdigest()
    size = f", {int(np.sum(sizes))} bytes" if len(sizes) and np.min(sizes) >= 0 else ""
    fp = {
        "method": "content" if content else "index",
        "sha256": hashlib.sha256(json.dumps(content_parts).encode()).hexdigest()
        if content
        else index_sha,
        "count": len(names),
        "unit": "files",
        "summary": f"{len(names)} files in {len(classes)} classes{size}",
        "parts": parts,
    }
    if content:
        fp["index"] = index_sha
    if len(names) <= NAMES_LIMIT:
        fp["names"] = names
    return fp


@dataclass(frozen=True)
class FolderHelp:
    """The recipe's words in the layout's errors: what the data is (`name`), the files' pattern
    in a class folder (`files`), where to get it (`source`) and how to sort a split that has no
    class folders (`sort`), e.g. a validation set downloaded flat. Empty: left out."""

    name: str = "the data"
    files: str = "*"
    source: str = ""
    sort: str = ""


PLAIN = FolderHelp()


def check_layout(root: Path, help_text: FolderHelp = PLAIN) -> None:
    """The data root, its train/ and val/ and their class folders exist (a few directory
    listings, no file reads). Empty class folders are found from the index (folder_indexes),
    which has listed them anyway."""
    root = Path(root)
    layout = f"{root}/train/<class>/{help_text.files} and {root}/val/<class>/{help_text.files}"
    if not root.is_dir():
        source = f" ({help_text.source})" if help_text.source else ""
        raise DataError(
            f"data root {root} not found: put {help_text.name} there as {layout}{source}, "
            "or set data.root to where it is"
        )
    for split in ("train", "val"):
        split_dir = root / split
        if not split_dir.is_dir():
            raise DataError(f"{split_dir} not found: the data must be laid out as {layout}")
        if not _class_names(split_dir):
            sort = f" ({help_text.sort})" if help_text.sort else ""
            raise DataError(
                f"{split_dir} has no class folders: its images must be in {split_dir}/<class>/"
                f"{sort}"
            )


def _some(names: list[str], k: int = 3) -> str:
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def _check_classes(root: Path, train: FolderIndex, val: FolderIndex) -> None:
    for index in (train, val):
        counts = np.bincount(index.labels, minlength=len(index.classes))
        empty = [c for c, n in zip(index.classes, counts, strict=True) if n == 0]
        if empty:
            suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
            others = f" (and {len(empty) - 1} other class folders)" if len(empty) > 1 else ""
            raise DataError(
                f"{index.root}/{empty[0]}{others} has no images ({suffixes}): "
                "add its images or delete the folder"
            )
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        differ = [
            f"only in {s}/: {_some(n)}" for s, n in (("train", only_train), ("val", only_val)) if n
        ]
        raise DataError(
            f"{root}/train has {len(train.classes)} classes and {root}/val {len(val.classes)}; "
            f"{'; '.join(differ)}: both need the same class folders"
        )


def folder_indexes(
    root: Path, cache_dir: Path | None = None, help_text: FolderHelp = PLAIN
) -> tuple[FolderIndex, FolderIndex]:
    """The (train, val) indexes of a class-folder data root, or a one-line DataError worded
    with the recipe's help_text."""
    root = Path(root)
    check_layout(root, help_text)
    train, val = load_index(root / "train", cache_dir), load_index(root / "val", cache_dir)
    _check_classes(root, train, val)
    return train, val


class ImageFiles(Dataset):
    """(image, label) per file of an index: the file decoded to a uint8 (3, H, W) RGB tensor
    (grayscale, CMYK, 16-bit and PNGs named .JPEG included), then `transform` (a
    transforms.v2 callable on that tensor, uint8 in and out) if given. A file that cannot be
    read or decoded (not an image, truncated, empty, gone) raises BadSample; the engine's
    loader decides whether that stops the run or the file is skipped. The training loop
    normalises each uint8 batch on the device (finish_on_device) with mean and std.

    Paths and labels are kept in numpy arrays, not lists: loader workers reading the items of
    a list of 1.28M str touch their reference counts, which copies those pages into every
    worker (~100 MB each); numpy's one buffer stays shared."""

    def __init__(self, index: FolderIndex, transform=None, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        require_decoder()  # missing torchcodec: one line here, not a traceback per worker
        self.root, self.classes, self.transform = index.root, index.classes, transform
        self.mean, self.std = tuple(mean), tuple(std)
        self.files = np.array([os.fsencode(f) for f in index.files])
        self.labels = np.array(index.labels, dtype=np.int64)
        # bytes per file (-1: an index built without them)
        self.sizes = np.array(index.sizes or [-1] * len(index.files), dtype=np.int64)
        self.cache_dir = index.cache_dir

    def fingerprint(self, content: bool = False) -> dict:
        """The split's fingerprint: its index, or with content=True its files' bytes."""
        return self._fingerprint(content)

    def _fingerprint(self, content: bool, digests: list[str] | None = None) -> dict:
        cache = Path(self.cache_dir) if self.cache_dir else None
        return folder_fingerprint(
            self.root, self.classes, self.files, self.sizes, self.labels, content, cache, digests
        )

    def __len__(self) -> int:
        return len(self.files)

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the transform (progressive resizing); the loader calls it per sample."""
        if hasattr(self.transform, "set_epoch"):
            self.transform.set_epoch(epoch)

    def path(self, i: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.files[i]))

    def read(self, i: int) -> torch.Tensor:
        """Sample i's file, its bytes as a 1-D uint8 tensor, or BadSample."""
        return read_bytes(self.path(i))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with sample_stage("read"):
            data = self.read(i)
        with sample_stage("decode"):
            image = decode_rgb(data, self.path(i))
        if self.transform is not None:
            with sample_stage("augment"):
                image = self.transform(image)
        return image, int(self.labels[i])

    def finish_on_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The loader's uint8 batch, normalised float32 on the device."""
        return normalise_on_device(x, device, self.mean, self.std)
