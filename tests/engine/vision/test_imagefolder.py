import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from engine.data.errors import BadSample, DataError
from engine.vision import imagefolder
from engine.vision.imagefolder import (
    FolderHelp,
    FolderIndex,
    ImageFiles,
    folder_indexes,
    load_index,
    scan_split,
)
from recipes.imagenet.data import imagenet_indexes
from tests.datagen_images import (
    jpeg_bytes,
    plant_empty_file,
    plant_jpeg,
    plant_not_an_image,
    plant_png_as_jpeg,
    plant_truncated_jpeg,
    settle,
    write_image_folder,
)


@pytest.fixture
def data(tmp_path) -> Path:
    return write_image_folder(tmp_path / "imagenet")


@pytest.fixture
def scans(monkeypatch) -> list[Path]:
    """Records every scan_split call (the slow, uncached listing)."""
    calls, real = [], imagefolder.scan_split

    def counted(split_dir):
        calls.append(Path(split_dir))
        return real(split_dir)

    monkeypatch.setattr(imagefolder, "scan_split", counted)
    return calls


def cache_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


def test_index_lists_images_by_class_then_name(data):
    extra = data / "train" / "n00000001"
    for name in ("Z.PNG", "extra.jpg", "b.webp", "README.txt", ".hidden.JPEG", "list.csv"):
        (extra / name).write_bytes(jpeg_bytes())
    (extra / "folder.jpg").mkdir()  # a folder with an image's name is no image
    (data / "train" / ".ipynb_checkpoints").mkdir()  # hidden folder: no class
    (data / "train" / "loose.JPEG").write_bytes(jpeg_bytes())  # not in a class folder

    index = scan_split(data / "train")
    assert index.root == str((data / "train").resolve())
    assert index.classes == ["n00000000", "n00000001", "n00000002"]
    class1 = ["Z.PNG", "b.webp", "extra.jpg", *(f"n00000001_{i}.JPEG" for i in range(6))]
    assert index.files == [
        *(f"n00000000/n00000000_{i}.JPEG" for i in range(6)),
        *(f"n00000001/{name}" for name in class1),
        *(f"n00000002/n00000002_{i}.JPEG" for i in range(6)),
    ]
    assert index.labels == [0] * 6 + [1] * 9 + [2] * 6
    assert len(index) == 21
    assert load_index(data / "train") == index


def test_val_names_follow_imagenet(data):
    val = scan_split(data / "val")
    assert val.files[:3] == [
        "n00000000/ILSVRC2012_val_00000001.JPEG",
        "n00000000/ILSVRC2012_val_00000002.JPEG",
        "n00000001/ILSVRC2012_val_00000003.JPEG",
    ]


def test_second_load_reads_the_json_cache_beside_the_data(data, monkeypatch):
    first = load_index(data / "train")
    (cache,) = cache_files(data / ".index-cache")
    assert cache.name.startswith("train-")
    assert json.loads(cache.read_text())["root"] == first.root  # JSON, never pickle

    def no_scan(split_dir):
        raise AssertionError("scanned although the cache is valid")

    monkeypatch.setattr(imagefolder, "scan_split", no_scan)
    assert load_index(data / "train") == first
    assert load_index(data / "train", data / ".index-cache") == first


def test_cache_is_keyed_by_split_path(data, tmp_path, scans):
    other = write_image_folder(tmp_path / "other", classes=2)
    cache = tmp_path / "cache"
    a, b = load_index(data / "train", cache), load_index(other / "train", cache)
    assert len(cache_files(cache)) == 2 and a != b
    assert load_index(data / "train", cache) == a and load_index(other / "train", cache) == b
    assert len(scans) == 2


def test_a_folder_still_changing_is_not_cached(data, scans):
    """Its mtime may not yet show the next change (mtime ticks are coarse on some systems)."""
    (data / "train" / "n00000000" / "new.JPEG").write_bytes(jpeg_bytes())
    load_index(data / "train")
    load_index(data / "train")
    assert len(scans) == 2
    settle(data)
    load_index(data / "train")
    load_index(data / "train")
    assert len(scans) == 3


def add_file(train: Path):
    (train / "n00000001" / "n00000001_new.JPEG").write_bytes(jpeg_bytes())


def remove_file(train: Path):
    (train / "n00000002" / "n00000002_3.JPEG").unlink()


def rename_file(train: Path):
    os.rename(train / "n00000000" / "n00000000_0.JPEG", train / "n00000000" / "renamed.JPEG")


def add_class(train: Path):
    (train / "n00000009").mkdir()
    (train / "n00000009" / "a.JPEG").write_bytes(jpeg_bytes())


def remove_class(train: Path):
    shutil.rmtree(train / "n00000001")


@pytest.mark.parametrize("change", [add_file, remove_file, rename_file, add_class, remove_class])
def test_cache_is_invalidated_by_a_change(data, change, scans):
    before = load_index(data / "train")
    change(data / "train")
    after = load_index(data / "train")
    assert len(scans) == 2
    assert after != before
    assert after == imagefolder.scan_split(data / "train")


@pytest.mark.parametrize("garbage", ["{not json", "[]", '{"format": 1}', "", '{"format": 99}'])
def test_a_corrupt_cache_is_rebuilt(data, garbage, scans):
    index = load_index(data / "train")
    (cache,) = cache_files(data / ".index-cache")
    cache.write_text(garbage)
    assert load_index(data / "train") == index
    assert json.loads(cache.read_text())["format"] == imagefolder.CACHE_FORMAT
    assert load_index(data / "train") == index
    assert len(scans) == 2


def test_a_read_only_data_root_caches_in_the_home_folder(data, tmp_path, monkeypatch, scans):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    folders = [data, *(p for p in data.rglob("*") if p.is_dir())]
    for folder in folders:
        folder.chmod(0o555)
    try:
        if os.access(data, os.W_OK):  # root ignores permission bits; a read-only mount does not
            real_access = os.access
            monkeypatch.setattr(
                imagefolder.os,
                "access",
                lambda p, mode: real_access(p, mode) and not Path(p).is_relative_to(data),
            )
        train, val = imagenet_indexes(data)
        assert (train, val) == imagenet_indexes(data)
    finally:
        for folder in folders:
            folder.chmod(0o755)
    assert len(scans) == 2
    assert not (data / ".index-cache").exists()
    assert len(cache_files(tmp_path / "home" / ".cache" / "recipes" / "index")) == 2


def test_an_unwritable_cache_warns_once_and_carries_on(data, tmp_path, monkeypatch):
    monkeypatch.setattr(imagefolder, "_warned_dirs", set())
    (tmp_path / "a-file").write_text("")
    unwritable = tmp_path / "a-file" / "cache"  # below a file: fails even for root
    with pytest.warns(UserWarning, match="cannot write the file index cache") as caught:
        train, val = imagenet_indexes(data, unwritable)
        imagenet_indexes(data, unwritable)
    assert len(caught) == 1
    assert len(train) == 18 and len(val) == 6


def structural_case(case: str, root: Path) -> Path:
    """Breaks a good data root in one way; returns the path the error must name."""
    if case == "root missing":
        shutil.rmtree(root)
        return root
    if case in ("train missing", "val missing"):
        split = root / case.split()[0]
        shutil.rmtree(split)
        return split
    if case == "val flat":  # as downloaded: 50,000 files directly in val/
        for image in list((root / "val").glob("*/*.JPEG")):
            image.rename(root / "val" / image.name)
        for folder in (root / "val").glob("n*"):
            folder.rmdir()
        return root / "val"
    if case == "empty class":
        (root / "val" / "n00000001").mkdir(exist_ok=True)
        for image in (root / "val" / "n00000001").iterdir():
            image.unlink()
        (root / "val" / "n00000001" / "notes.txt").write_text("no image here")
        return root / "val" / "n00000001"
    if case == "classes differ":
        (root / "val" / "n00000002").rename(root / "val" / "n00000007")
        return root
    raise ValueError(case)


STRUCTURAL = {
    "root missing": ["image-net.org", "valprep", "/train/<class>/*.JPEG", "/val/<class>/*.JPEG"],
    "train missing": ["not found", "/train/<class>/*.JPEG"],
    "val missing": ["not found", "/val/<class>/*.JPEG"],
    "val flat": ["no class folders", "valprep"],
    "empty class": ["no images", "delete the folder"],
    "classes differ": ["only in train/: n00000002", "only in val/: n00000007", "has 3 classes"],
}


@pytest.mark.parametrize("case", list(STRUCTURAL))
def test_each_layout_error_is_one_line_naming_the_path(case, data):
    path = structural_case(case, data)
    with pytest.raises(DataError) as err:
        imagenet_indexes(data)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message or str(path.resolve()) in message
    for words in STRUCTURAL[case]:
        assert words in message


def test_the_layout_errors_take_the_recipes_words_and_name_no_dataset_without_them(data):
    """The engine's module words the errors plainly; a recipe says what its data is, where to
    get it and how to sort it (the imagenet recipe: the cases above)."""
    shutil.rmtree(data)
    with pytest.raises(DataError) as err:
        folder_indexes(data)
    assert str(err.value) == (
        f"data root {data} not found: put the data there as {data}/train/<class>/* and "
        f"{data}/val/<class>/*, or set data.root to where it is"
    )
    flowers = FolderHelp("Flowers-102", "*.jpg", "see recipes/flowers/README.md", "sort it")
    with pytest.raises(DataError) as err:
        folder_indexes(data, help_text=flowers)
    assert str(err.value) == (
        f"data root {data} not found: put Flowers-102 there as {data}/train/<class>/*.jpg and "
        f"{data}/val/<class>/*.jpg (see recipes/flowers/README.md), or set data.root to where "
        "it is"
    )
    (data / "train" / "a").mkdir(parents=True)
    (data / "val").mkdir()
    with pytest.raises(DataError) as err:
        folder_indexes(data)
    assert str(err.value).endswith(f"its images must be in {data}/val/<class>/")
    with pytest.raises(DataError, match=r"val/<class>/ \(sort it\)$"):
        folder_indexes(data, help_text=flowers)


def test_layout_errors_come_from_a_cached_index_too(data):
    (data / "val" / "n00000000" / "ILSVRC2012_val_00000001.JPEG").unlink()
    imagenet_indexes(data)
    (data / "val" / "n00000000" / "ILSVRC2012_val_00000002.JPEG").unlink()
    settle(data)
    with pytest.raises(DataError, match="n00000000 has no images"):
        imagenet_indexes(data)
    with pytest.raises(DataError, match="n00000000 has no images"):
        imagenet_indexes(data)  # now from the cache


def test_many_differing_classes_are_counted_not_listed(tmp_path):
    root = write_image_folder(tmp_path / "d", classes=8, train_per_class=1, val_per_class=1)
    for k in range(5):
        (root / "val" / f"n0000000{k}").rename(root / "val" / f"x{k}")
    with pytest.raises(DataError) as err:
        imagenet_indexes(root)
    assert "only in train/: n00000000, n00000001, n00000002 and 2 more" in str(err.value)
    assert "only in val/: x0, x1, x2 and 2 more" in str(err.value)


def one_file_index(tmp_path: Path, plant, **kwargs) -> FolderIndex:
    (tmp_path / "split" / "cls").mkdir(parents=True)
    plant(tmp_path / "split" / "cls" / "f.JPEG", **kwargs)
    return scan_split(tmp_path / "split")


def truncated_before_the_end_marker(path: Path):
    path.write_bytes(jpeg_bytes(seed=4)[:-2])


def deleted_after_indexing(path: Path):
    path.write_bytes(jpeg_bytes())


BAD = {
    "not an image": (plant_not_an_image, {}),
    "truncated to half": (plant_truncated_jpeg, {}),
    "truncated to a tenth": (plant_truncated_jpeg, {"keep": 0.1}),
    "end marker missing": (truncated_before_the_end_marker, {}),
    "empty file": (plant_empty_file, {}),
    "deleted": (deleted_after_indexing, {}),
}


@pytest.mark.parametrize("case", list(BAD))
def test_an_undecodable_file_raises_bad_sample(case, tmp_path):
    plant, kwargs = BAD[case]
    index = one_file_index(tmp_path, plant, **kwargs)
    if case == "deleted":
        (Path(index.root) / index.files[0]).unlink()
    with pytest.raises(BadSample) as err:
        ImageFiles(index)[0]
    assert err.value.path == os.path.join(index.root, "cls", "f.JPEG")
    assert err.value.reason and ".cpp" not in err.value.reason
    assert not isinstance(err.value, DataError)  # the loader decides: skip or stop


def plant_16bit_png(path: Path):
    Image.fromarray(np.full((30, 20), 40000, dtype=np.uint16)).save(path, format="PNG")


@pytest.mark.parametrize(
    "plant, kwargs",
    [
        (plant_png_as_jpeg, {}),
        (plant_jpeg, {"mode": "CMYK"}),
        (plant_jpeg, {"mode": "L"}),
        (plant_16bit_png, {}),
    ],
    ids=["png named JPEG", "CMYK JPEG", "grayscale JPEG", "16-bit PNG"],
)
def test_other_image_kinds_decode_to_rgb_uint8(plant, kwargs, tmp_path):
    image, label = ImageFiles(one_file_index(tmp_path, plant, **kwargs))[0]
    assert image.dtype == torch.uint8 and image.ndim == 3 and image.shape[0] == 3
    assert label == 0
    if plant is plant_16bit_png:
        assert image.shape == (3, 30, 20) and (image == 40000 >> 8).all()


def test_image_files_give_rgb_tensors_and_labels(data):
    train, _ = imagenet_indexes(data)
    dataset = ImageFiles(train)
    assert dataset.classes == train.classes and len(dataset) == len(train) == 18
    for i in (0, 7, 17):
        image, label = dataset[i]
        assert isinstance(label, int) and label == train.labels[i]
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        assert 32 <= image.shape[1] <= 48 and 38 <= image.shape[2] <= 58
        with Image.open(Path(train.root) / train.files[i]) as reference:
            assert image.shape[1:] == (reference.height, reference.width)
    # class colours differ, so a model can learn them
    means = [dataset[i][0].float().mean((1, 2)) for i in (0, 6, 12)]
    assert min((a - b).abs().max() for a, b in [(means[0], means[1]), (means[1], means[2])]) > 5


def test_image_files_apply_the_transform_and_pass_the_epoch_on(data):
    class Resize:
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

        def __call__(self, image):
            return v2.Resize((16, 16), antialias=True)(image)

    transform = Resize()
    dataset = ImageFiles(scan_split(data / "val"), transform)
    image, label = dataset[5]
    assert image.shape == (3, 16, 16) and label == 2
    dataset.set_epoch(3)
    assert transform.epochs == [3]
    ImageFiles(scan_split(data / "val"), v2.Resize(8)).set_epoch(1)  # no set_epoch: ignored


def test_image_files_keep_paths_in_one_shared_buffer(data):
    dataset = ImageFiles(scan_split(data / "train"))
    assert isinstance(dataset.files, np.ndarray) and dataset.files.dtype.kind == "S"
    assert stat.S_ISREG(os.stat(os.path.join(dataset.root, os.fsdecode(dataset.files[3]))).st_mode)
