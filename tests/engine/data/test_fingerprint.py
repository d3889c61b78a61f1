"""The data's fingerprint (engine.data.fingerprint): in-memory data by its tensors' bytes, a
folder of files by its index (names, sizes, labels; no file read) or by content (cached), and
a resume over other data refused in one line that names the change."""

from __future__ import annotations

import builtins
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from engine import config as C
from engine.checkpoint.state import check_data
from engine.data import fingerprint as F
from engine.vision import imagefolder
from engine.vision.imagefolder import ImageFiles, load_index
from recipes.digits.data import Digits
from tests.datagen_images import settle, write_image_folder


@pytest.fixture
def data(tmp_path) -> Path:
    return write_image_folder(tmp_path / "imagenet")


def split(root: Path, name: str = "train") -> ImageFiles:
    return ImageFiles(load_index(root / name))


def test_in_memory_data_is_fingerprinted_by_its_tensors_not_its_settings():
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    same = F.of(Digits(x.clone(), y.clone(), shift=0))
    assert F.of(Digits(x, y, shift=1)) == same  # the shift is config, compared elsewhere
    assert same["count"] == 6 and same["unit"] == "samples" and same["method"] == "tensors"
    changed = x.clone()
    changed[3, 1] += 1
    assert F.of(Digits(changed, y)) != same
    assert F.of(TensorDataset(x, y)) == F.of(TensorDataset(x.clone(), y.clone()))
    assert F.of(TensorDataset(x, y))["sha256"] != F.of(TensorDataset(changed, y))["sha256"]


def test_a_changed_split_is_named_with_its_counts():
    x, y = torch.zeros(6, 2), torch.arange(6)
    old = F.of_run(TensorDataset(x, y), TensorDataset(x[:2], y[:2]))
    new = F.of_run(TensorDataset(x[:5], y[:5]), TensorDataset(x[:2], y[:2]))
    assert F.difference(old, old) is None
    assert F.difference(old, new).startswith("train data 6 -> 5 samples (sha256 ")
    assert "eval" not in F.difference(old, new)
    brief = F.brief(old)["train"]
    assert set(brief) == {"method", "sha256", "count", "unit", "summary"}


def test_adding_one_jpeg_changes_the_index_fingerprint_and_names_the_file(data):
    before = split(data).fingerprint()
    assert before["method"] == "index" and before["count"] == 18
    assert before["summary"].startswith("18 files in 3 classes, ")
    shutil.copy(data / "train/n00000001/n00000001_0.JPEG", data / "train/n00000001/extra.JPEG")
    settle(data)
    after = split(data).fingerprint()
    assert after["sha256"] != before["sha256"] and after["count"] == 19
    old, new = {"train": before}, {"train": after}
    assert F.difference(old, new) == "train data 18 -> 19 files (n00000001/extra.JPEG added)"
    del before["names"], after["names"]  # a large split: only its classes tell where
    assert F.difference(old, new) == "train data 18 -> 19 files (class n00000001: 6 -> 7 files)"


def test_the_index_fingerprint_reads_no_image_and_the_content_one_reads_each_once(
    data, monkeypatch
):
    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file).upper().endswith(".JPEG"):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    files = split(data)
    index = files.fingerprint()
    assert opened == []
    content = files.fingerprint(content=True)
    assert len(opened) == 18 and content["method"] == "content"
    assert content["index"] == index["sha256"] and F.same(index, content)
    assert files.fingerprint(content=True) == content and len(opened) == 18  # cached

    # the same size, other bytes, the folder's and the file's mtimes kept: only content sees it
    path = data / "train/n00000000/n00000000_2.JPEG"
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    settle(data)
    assert split(data).fingerprint() == index
    changed = split(data).fingerprint(content=True)
    assert changed["sha256"] != content["sha256"]
    text = F.difference({"train": content}, {"train": changed})
    assert text == "train data other 18 files (class n00000000: other files or sizes)"


def test_the_index_cache_keeps_the_sizes(data):
    first = load_index(data / "train")
    assert first.sizes == [
        (data / "train" / f).stat().st_size for f in first.files
    ] and first == imagefolder.scan_split(data / "train")
    cached = load_index(data / "train")
    assert cached.sizes == first.sizes


def resume_cfg(allow: bool = False):
    return SimpleNamespace(run=SimpleNamespace(allow_data_change=allow))


def test_a_resume_over_other_data_is_one_line_unless_allowed(data):
    saved = F.of_run(split(data), split(data, "val"))
    source = (Path("runs/x/checkpoints/step-4.pt"), {"data": saved})
    check_data(resume_cfg(), source, saved)  # the same data
    shutil.copy(data / "train/n00000002/n00000002_1.JPEG", data / "train/n00000002/new.JPEG")
    settle(data)
    now = F.of_run(split(data), split(data, "val"))
    with pytest.raises(C.ConfigError) as err:
        check_data(resume_cfg(), source, now)
    line = str(err.value)
    assert "\n" not in line
    assert "train data 18 -> 19 files (n00000002/new.JPEG added)" in line
    assert "eval" not in line and "run.allow_data_change=true" in line
    check_data(resume_cfg(allow=True), source, now)
    check_data(resume_cfg(), (source[0], {}), now)  # a checkpoint written before: not compared
