"""The CIFAR-10 batch reader: layout, order, refusal of doctored pickles, one-line errors."""

import os
import pickle
import pickletools
import socket

import numpy as np
import pytest
import torch

from engine.data.errors import DataError
from recipes.cifar10 import cifar_files
from recipes.cifar10.cifar_files import FOLDER, download, read_classes, read_split, require
from tests.datagen_cifar import CLASSES, write_cifar_batches, write_doctored_batch

BATCHES = [f"data_batch_{i}" for i in range(1, 6)]


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.strip() == msg, msg
    return msg


def plain_load(path):
    """A trusted file read as torchvision reads it, as the oracle."""
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="latin1")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def plain_dump(obj, path):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def globals_in(path) -> set[str]:
    ops = pickletools.genops(path.read_bytes())
    return {arg for op, arg, _ in ops if op.name in ("GLOBAL", "STACK_GLOBAL")}


@pytest.fixture(params=[True, False], ids=["python2-opcodes", "python3-protocol2"])
def root(request, tmp_path):
    return write_cifar_batches(tmp_path, n_train=23, n_test=7, seed=3, python2=request.param)


def test_the_generated_files_reference_what_the_official_files_do(tmp_path):
    py2 = write_cifar_batches(tmp_path / "a") / FOLDER / "data_batch_1"
    py3 = write_cifar_batches(tmp_path / "b", python2=False) / FOLDER / "data_batch_1"
    arrays = {"numpy ndarray", "numpy dtype"}
    assert globals_in(py2) == arrays | {"numpy.core.multiarray _reconstruct"}
    assert globals_in(py3) == arrays | {"numpy._core.multiarray _reconstruct", "_codecs encode"}


def test_round_trip_shapes_dtypes_labels_and_batch_order(root):
    folder = root / FOLDER
    for train, names, n in ((True, BATCHES, 23), (False, ["test_batch"], 7)):
        images, labels = read_split(root, train)
        assert images.shape == (n, 3, 32, 32) and images.dtype == torch.uint8
        assert labels.shape == (n,) and labels.dtype == torch.int64
        raw = [plain_load(folder / name) for name in names]
        assert [len(b["data"]) for b in raw] == ([5, 5, 5, 4, 4] if train else [7])
        expect = np.concatenate([b["data"] for b in raw]).reshape(n, 3, 32, 32)
        assert torch.equal(images, torch.from_numpy(expect))
        assert labels.tolist() == [y for b in raw for y in b["labels"]]


def test_channel_layout_puts_r_g_b_planes_in_channels_0_1_2(root):
    first = plain_load(root / FOLDER / "data_batch_1")["data"][0]
    images, _ = read_split(root, train=True)
    row, col = 5, 17  # an arbitrary pixel: row-major offset row * 32 + col in each plane
    rgb = [int(first[plane * 1024 + row * 32 + col]) for plane in range(3)]
    assert images[0, :, row, col].tolist() == rgb


def test_torchvision_reads_the_python2_files_as_we_do(tmp_path, monkeypatch):
    """An independent reader: torchvision's CIFAR10 (plain pickle, HWC) on trusted files."""
    from torchvision.datasets import CIFAR10

    # the generated files have other md5 sums than the official ones
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *a, **k: True)
    root = write_cifar_batches(tmp_path, n_train=23, n_test=7, seed=5)
    for train in (True, False):
        theirs = CIFAR10(root, train=train)
        images, labels = read_split(root, train)
        assert torch.equal(images.permute(0, 2, 3, 1), torch.from_numpy(theirs.data))
        assert labels.tolist() == theirs.targets
        assert read_classes(root) == theirs.classes


def test_classes_come_from_batches_meta(root):
    assert read_classes(root) == CLASSES
    meta = plain_load(root / FOLDER / "batches.meta")
    meta["label_names"] = list(reversed(meta["label_names"]))
    plain_dump(meta, root / FOLDER / "batches.meta")
    assert read_classes(root) == CLASSES[::-1]


def test_str_keys_are_accepted_as_well_as_bytes(tmp_path):
    """Bytes keys are covered by the python3-protocol2 files; here a re-dump with str keys."""
    root = write_cifar_batches(tmp_path, n_train=10, n_test=4)
    path = root / FOLDER / "test_batch"
    batch = plain_load(path)
    plain_dump({**batch, "labels": [9] * 4}, path)
    assert read_split(root, train=False)[1].tolist() == [9] * 4


@pytest.mark.parametrize("func", [exec, os.system], ids=["exec", "os.system"])
def test_a_doctored_batch_is_refused_in_one_line_and_its_code_never_runs(tmp_path, func):
    # the payload is live: a plain pickle.load runs it
    live = write_doctored_batch(tmp_path / "live", func)
    plain_load(tmp_path / "live")
    assert live.exists()

    root = write_cifar_batches(tmp_path / "data", n_train=10, n_test=4)
    marker = write_doctored_batch(root / FOLDER / "data_batch_3", func)
    with pytest.raises(DataError) as excinfo:
        read_split(root, train=True)
    msg = one_line_error(excinfo)
    assert not marker.exists()
    assert str(root / FOLDER / "data_batch_3") in msg and "data.download=true" in msg
    assert f".{func.__name__}," in msg  # names the global it refused (posix.system, ...)


def test_codecs_encode_is_admitted_only_for_latin1(tmp_path):
    class Encoded:
        def __reduce__(self):
            import codecs

            return codecs.encode, ("abc", "rot13")

    root = write_cifar_batches(tmp_path, n_train=10, n_test=4, python2=False)
    path = root / FOLDER / "test_batch"
    plain_dump({**plain_load(path), "batch_label": Encoded()}, path)
    with pytest.raises(DataError, match="rot13") as excinfo:
        read_split(root, train=False)
    one_line_error(excinfo)


# Each turns a valid batch into one wrong in one way that the reader must catch.
DAMAGE = {
    "not a dict": lambda b: [1, 2, 3],
    "no data": lambda b: {k: v for k, v in b.items() if k != "data"},
    "no labels": lambda b: {k: v for k, v in b.items() if k != "labels"},
    "data float": lambda b: {**b, "data": b["data"].astype(np.float32)},
    "data short rows": lambda b: {**b, "data": b["data"][:, :3000]},
    "data 4-d": lambda b: {**b, "data": b["data"].reshape(-1, 3, 32, 32)},
    "data a list": lambda b: {**b, "data": b["data"].tolist()},
    "label 10": lambda b: {**b, "labels": [10] + b["labels"][1:]},
    "label -1": lambda b: {**b, "labels": [-1] + b["labels"][1:]},
    "labels float": lambda b: {**b, "labels": [0.5] * len(b["labels"])},
    "labels too few": lambda b: {**b, "labels": b["labels"][1:]},
}


@pytest.mark.parametrize("case", ["truncated", *DAMAGE])
def test_a_damaged_batch_is_a_one_line_data_error_naming_the_file(tmp_path, case):
    root = write_cifar_batches(tmp_path, n_train=10, n_test=4)
    path = root / FOLDER / "test_batch"
    assert read_split(root, train=False)[0].shape == (4, 3, 32, 32)  # valid before damage
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:2000])
    else:
        plain_dump(DAMAGE[case](plain_load(path)), path)
    with pytest.raises(DataError) as excinfo:
        read_split(root, train=False)
    msg = one_line_error(excinfo)
    assert str(path) in msg and "data.download=true" in msg


def test_garbage_bytes_are_a_data_error(tmp_path):
    root = write_cifar_batches(tmp_path, n_train=10, n_test=4)
    (root / FOLDER / "batches.meta").write_bytes(os.urandom(500))
    with pytest.raises(DataError) as excinfo:
        read_classes(root)
    assert "batches.meta" in one_line_error(excinfo)


@pytest.mark.parametrize("missing", [None, "data_batch_4", "test_batch", "batches.meta"])
def test_missing_data_says_where_the_files_go_and_how_to_get_them(tmp_path, missing):
    root = tmp_path / "cifar"
    if missing:
        write_cifar_batches(root, n_train=10, n_test=4)
        (root / FOLDER / missing).unlink()
    for call in (lambda: require(root), lambda: read_split(root, True), lambda: read_classes(root)):
        with pytest.raises(DataError) as excinfo:
            call()
        msg = one_line_error(excinfo)
        assert f"{root / FOLDER}/" in msg and (missing or "folder") in msg
        assert "data.download=true" in msg and "cifar-10-python.tar.gz" in msg
        assert "https://www.cs.toronto.edu/~kriz/cifar.html" in msg


@pytest.fixture
def no_route_out(monkeypatch):
    """Downloads go to a closed local port, whatever the machine's network, and a socket
    stalls for at most a few seconds (torchvision's urlopen sets no timeout of its own)."""
    for var in ("https_proxy", "http_proxy", "HTTPS_PROXY", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5)
    yield
    socket.setdefaulttimeout(previous)


def test_a_failed_download_is_a_one_line_data_error(tmp_path, no_route_out):
    with pytest.raises(DataError) as excinfo:
        download(tmp_path / "cifar")
    msg = one_line_error(excinfo)
    assert "could not download CIFAR-10 from https://www.cs.toronto.edu/" in msg
    assert str(tmp_path / "cifar") in msg
    assert not (tmp_path / "cifar" / FOLDER).exists()


def test_download_skips_when_the_files_are_there(tmp_path, no_route_out):
    root = write_cifar_batches(tmp_path, n_train=10, n_test=4)
    before = {f: (root / FOLDER / f).read_bytes() for f in cifar_files.FILES}
    download(root)  # no network here: it would fail if it tried
    assert {f: (root / FOLDER / f).read_bytes() for f in cifar_files.FILES} == before
