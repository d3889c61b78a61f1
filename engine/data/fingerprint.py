"""What data a run trained on, as a fingerprint: recorded in env.json, summary.json, W&B's
config and every checkpoint (a recorded fact, like the code's identity), and compared when
a run resumes (engine.checkpoint.state): other data stops the resume in one line.

A dataset fingerprints itself when it has `fingerprint(content)` (engine.recipe's
`fingerprinter`): a folder of files by its index (names, sizes, labels; no file is read) or,
with content=True, by the files' bytes; a text corpus by its bytes. Any other dataset gets
the generic one: the sha256 of its tensors' and arrays' bytes, attribute by attribute (a
TensorDataset's tensors, a recipe's images and labels), with its length and class names;
its settings and objects (transforms) are config and code, compared elsewhere. A dataset
holding no tensor (generated data) is fingerprinted by its plain values (sizes, counts).

A fingerprint is a dict: `method` (index, content, tensors, bytes), `sha256`, `count` of
`unit`s (files, samples, bytes), `summary` (a few words for people) and, where cheap,
`parts` (per class: [count, digest]) and `names` (a small split's file names), which let a
refusal name the first difference. `brief` drops those two: the form env.json, summary.json
and W&B record."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from engine import recipe as contract

SPLITS = ("train", "eval")
NAMES_LIMIT = 1000  # a split of at most this many files records its names (first difference)
BRIEF = ("method", "sha256", "count", "unit", "summary")


def _plain(value: Any) -> bool:
    if isinstance(value, bool | int | float | str) or value is None:
        return True
    return isinstance(value, list | tuple) and all(_plain(v) for v in value)


def _hash_tensor(digest, name: str, t: torch.Tensor) -> None:
    flat = t.detach().cpu().contiguous().reshape(-1)
    digest.update(f"\0{name}\0{flat.dtype}\0{tuple(t.shape)}\0".encode())
    if not flat.numel():
        return
    try:
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    except (RuntimeError, TypeError):  # a layout or dtype numpy cannot view: its values
        digest.update(repr(flat.tolist()).encode())


def _hash_array(digest, name: str, a: np.ndarray) -> None:
    if a.dtype.kind in "biufc":
        _hash_tensor(digest, name, torch.from_numpy(np.ascontiguousarray(a)))
        return
    digest.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
    if a.dtype.kind in "SUV":  # names, bytes: fixed-width buffers
        digest.update(np.ascontiguousarray(a).tobytes())
    else:  # objects
        digest.update(json.dumps(a.tolist(), default=str).encode())


def _hash_value(digest, name: str, value: Any, plain: bool, depth: int = 0) -> bool:
    """The value into the digest (plain values only when `plain`); False when it held
    nothing hashed."""
    if isinstance(value, torch.Tensor):
        _hash_tensor(digest, name, value)
    elif isinstance(value, np.ndarray):
        _hash_array(digest, name, value)
    elif _plain(value):
        if not plain:
            return False
        digest.update(f"\0{name}\0{json.dumps(value, default=str)}".encode())
    elif isinstance(value, list | tuple):
        hashed = [_hash_value(digest, f"{name}[{i}]", v, plain, depth) for i, v in enumerate(value)]
        return any(hashed)
    elif depth < 3 and isinstance(value, Dataset) and hasattr(value, "__dict__"):
        return _hash_attributes(digest, value, plain, f"{name}.", depth + 1)  # Subset, a wrapper
    else:
        return False
    return True


def _hash_attributes(digest, obj: Any, plain: bool, prefix: str = "", depth: int = 0) -> bool:
    found = False
    for name in sorted(vars(obj)):
        found |= _hash_value(digest, prefix + name, vars(obj)[name], plain, depth)
    return found


def generic(dataset: Any) -> dict[str, Any]:
    """The sha256 of a dataset's tensors and arrays (by attribute name: its data, not its
    settings), its length and class names; a dataset holding none (generated data) by its
    plain values (sizes, counts) instead."""
    count = len(dataset)
    classes = contract.classes(dataset)
    digest = hashlib.sha256(json.dumps([count, classes], default=str).encode())
    if not _hash_attributes(digest, dataset, plain=False):
        _hash_attributes(digest, dataset, plain=True)
    summary = f"{count} samples" + (f", {len(classes)} classes" if classes else "")
    return {
        "method": "tensors",
        "sha256": digest.hexdigest(),
        "count": count,
        "unit": "samples",
        "summary": summary,
    }


def of(dataset: Any, content: bool = False) -> dict[str, Any]:
    """The dataset's own fingerprint(content) where it has one, else the generic one."""
    own = contract.fingerprinter(dataset)
    return own(content) if own is not None else generic(dataset)


def of_run(train: Any, held_out: Any, method: str = "index") -> dict[str, dict[str, Any]]:
    """Both splits' fingerprints, each on its own."""
    return {"train": of(train, method == "content"), "eval": of(held_out, method == "content")}


def brief(fingerprints: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Without the per-class parts and names: what env.json, summary.json and W&B record."""
    return {s: {k: fp[k] for k in BRIEF if k in fp} for s, fp in fingerprints.items()}


# ---------------------------------------------------------------- comparing


def _index_sha(fp: dict[str, Any]) -> str | None:
    """The index fingerprint of a folder (a content fingerprint carries it as `index`)."""
    return fp.get("index") if fp.get("method") == "content" else fp.get("sha256")


def same(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether two fingerprints of a split say the same data; a folder fingerprinted by
    index once and by content the other time is compared by its index."""
    if old.get("method") == new.get("method"):
        return old.get("sha256") == new.get("sha256")
    return _index_sha(old) is not None and _index_sha(old) == _index_sha(new)


def first_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Where two fingerprints of a split first differ, as far as they can tell: a file
    added or removed (small splits name their files), else a class whose files changed."""
    names_old, names_new = old.get("names"), new.get("names")
    if isinstance(names_old, list) and isinstance(names_new, list):
        a, b = set(names_old), set(names_new)
        if a != b:
            name = min(a ^ b)
            return f"{name} {'added' if name in b else 'removed'}"
        if names_old != names_new:
            return "the same files in another order or other classes"
    parts_old, parts_new = old.get("parts"), new.get("parts")
    if isinstance(parts_old, dict) and isinstance(parts_new, dict):
        for cls in sorted(parts_old.keys() | parts_new.keys()):
            if cls not in parts_new:
                return f"class {cls} removed"
            if cls not in parts_old:
                return f"class {cls} added"
            if parts_old[cls] != parts_new[cls]:
                (n0, _), (n1, _) = parts_old[cls], parts_new[cls]
                what = f"{n0} -> {n1} files" if n0 != n1 else "other files or sizes"
                return f"class {cls}: {what}"
    if names_old is not None and names_old == names_new:
        return "the same names, other sizes or contents"
    return ""


def split_difference(split: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    """`train data 12 -> 13 files (b/extra.JPEG added)`."""
    unit = new.get("unit") or old.get("unit") or "samples"
    n0, n1 = old.get("count"), new.get("count")
    text = f"{split} data {n0} -> {n1} {unit}" if n0 != n1 else f"{split} data other {n1} {unit}"
    where = first_difference(old, new)
    if not where:
        where = f"sha256 {str(old.get('sha256'))[:12]} -> {str(new.get('sha256'))[:12]}"
    return f"{text} ({where})"


def difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The splits whose data differ, one clause each; None: the same data (a split one side
    did not record is not compared)."""
    changes = [
        split_difference(split, saved[split], current[split])
        for split in SPLITS
        if isinstance(saved.get(split), dict)
        and isinstance(current.get(split), dict)
        and not same(saved[split], current[split])
    ]
    return "; ".join(changes) or None
