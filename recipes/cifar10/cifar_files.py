"""The official CIFAR-10 python batches (`<root>/cifar-10-batches-py/`), read without trusting
them: the batches are pickles, and a plain `pickle.load` of a doctored file runs its code. The
unpickler here admits only the globals the official files hold, so anything else is refused."""

from __future__ import annotations

import codecs
import pickle
import socket
import tarfile
from pathlib import Path

import numpy as np
import torch

from engine.data.errors import DataError

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct

FOLDER = "cifar-10-batches-py"
TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
FILES = [*TRAIN, "test_batch", "batches.meta"]
PAGE = "https://www.cs.toronto.edu/~kriz/cifar.html"
DOWNLOAD_TIMEOUT_S = 60  # per socket operation: a stalled server ends in a DataError, not a hang
REDOWNLOAD = "delete it and download again (data.download=true)"
LATIN1 = ("latin1", "latin-1")


class _Refused(Exception):
    """A global or an argument that the official files never hold."""


def _latin1_encode(text, encoding="utf-8", errors="strict"):
    # python3's pickle at protocol <= 2 writes bytes as _codecs.encode(str, "latin1"); other
    # encodings (zlib, rot13, ...) never occur there and are refused.
    if encoding not in LATIN1:
        raise _Refused(f"_codecs.encode with encoding {encoding!r}")
    return codecs.encode(text, encoding, errors)


# What the official files (python 2 cPickle, numpy 1) and python3 protocol-2 re-creations
# reference (checked with pickletools.dis): numpy's array reconstruction under its numpy-1 and
# numpy-2 module names, ndarray, dtype, and (python3 only) _codecs.encode for bytes.
ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED:
            raise _Refused(f"{module}.{name}")
        return ALLOWED[(module, name)]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _load(path: Path) -> dict:
    """The batch's dict with str keys; every failure is a one-line DataError."""
    try:
        with open(path, "rb") as f:
            obj = _BatchUnpickler(f, encoding="latin1").load()
    except _Refused as e:
        raise DataError(
            f"{path} is not an official CIFAR-10 batch: it references {e}, which the official "
            f"files never hold; {REDOWNLOAD}"
        ) from None
    except Exception as e:  # truncated or garbled: pickle and numpy raise many kinds
        raise DataError(f"{path} is unreadable ({_one_line(e)}); {REDOWNLOAD}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a {type(obj).__name__}, not a CIFAR-10 dict; {REDOWNLOAD}")
    # Python 2 str keys read as str under latin1; bytes keys (python3 re-creations) stay bytes.
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _load(path)
    missing = [k for k in ("data", "labels") if k not in batch]
    if missing:
        raise DataError(f"{path} has no {' or '.join(missing)} entry; {REDOWNLOAD}")
    data, labels = batch["data"], np.asarray(batch["labels"])
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2):
        what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: data is {what}, not uint8 rows of 3072 bytes; {REDOWNLOAD}")
    if data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: data rows are {data.shape[1]} bytes, not 3072; {REDOWNLOAD}")
    if labels.dtype.kind not in "iu" or labels.shape != (len(data),):
        raise DataError(
            f"{path}: labels are {labels.dtype} {labels.shape}, not {len(data)} integers "
            f"(one per image); {REDOWNLOAD}"
        )
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise DataError(
            f"{path}: labels span {labels.min()}..{labels.max()}, not 0..9; {REDOWNLOAD}"
        )
    return data, labels


def require(root: Path) -> None:
    """One-line DataError unless all seven official files are in `<root>/cifar-10-batches-py/`."""
    folder = Path(root) / FOLDER
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        what = "the folder is missing" if not folder.is_dir() else "missing " + ", ".join(missing)
        raise DataError(
            f"CIFAR-10 not found in {folder}/ ({what}): set data.download=true where the network "
            f"allows, or download cifar-10-python.tar.gz from {PAGE} and extract it into {root}"
        )


def read_split(root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (N, 3, 32, 32) and int64 labels (N,): train = data_batch_1..5 in order,
    test = test_batch. Each official row is 1024 R, then 1024 G, then 1024 B bytes, row-major."""
    require(root)
    batches = [_read_batch(Path(root) / FOLDER / f) for f in (TRAIN if train else ["test_batch"])]
    data = np.concatenate([d for d, _ in batches]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([y for _, y in batches]).astype(np.int64)
    return torch.from_numpy(data), torch.from_numpy(labels)


def read_classes(root: Path) -> list[str]:
    """The ten class names from batches.meta (`label_names`), in label order."""
    require(root)
    path = Path(root) / FOLDER / "batches.meta"
    names = _load(path).get("label_names")
    if not isinstance(names, list) or len(names) != 10:
        raise DataError(f"{path} has no list of 10 label_names; {REDOWNLOAD}")
    names = [n.decode("latin1") if isinstance(n, bytes) else n for n in names]
    if not all(isinstance(n, str) for n in names):
        raise DataError(f"{path}: label_names are not strings; {REDOWNLOAD}")
    return names


def download(root: Path) -> None:
    """Fetch and extract the official archive into root, unless the files are already there."""
    root = Path(root)
    if all((root / FOLDER / f).is_file() for f in FILES):
        return
    # Imported here: torchvision is slow to import and only a download needs it. Only the
    # class attributes of CIFAR10 are used: its own loader would plain-unpickle the files.
    from torchvision.datasets import CIFAR10  # start-up time: only a download needs it
    from torchvision.datasets.utils import download_and_extract_archive  # start-up time

    previous = socket.getdefaulttimeout()
    if previous is None:  # torchvision's urlopen sets no timeout: a stalled server would hang
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        download_and_extract_archive(
            CIFAR10.url, root, filename=CIFAR10.filename, md5=CIFAR10.tgz_md5
        )
    except (OSError, RuntimeError, EOFError, tarfile.TarError) as e:  # URLError is an OSError
        raise DataError(
            f"could not download CIFAR-10 from {CIFAR10.url} ({_one_line(e)}); "
            f"download it elsewhere and extract into {root}"
        ) from None
    finally:
        socket.setdefaulttimeout(previous)
