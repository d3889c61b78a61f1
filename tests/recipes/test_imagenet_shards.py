"""The imagenet recipe from tar shards (make shards, data.format=shards) on a small folder of
real JPEG files: the shards hold the folder's bytes, labels and fingerprint, a run stopped
mid-epoch resumes from them (and from node-local copies) bitwise, a stopped make shards
continues, a damaged shard or sample is one line. Two gloo processes from shards against the
same run from the folder: tests/recipes/test_finetune_runs.py, which has that run already."""

import contextlib
import io
import json
import os
import shutil
import tarfile

import pytest
import torch

from engine import cli
from engine.config import ConfigError
from engine.data.errors import DataError
from engine.data.loaders import SeededSamples
from engine.seeding import seed_sample
from launch import cli as launch_cli
from recipes.imagenet.data import DataConfig, build_datasets
from tests.datagen_images import SMALL_ARCH, write_image_folder
from tests.helpers import QUIET, final_checkpoint, records, same_weights
from tests.recipes.cli_calls import engine_calls

pytestmark = pytest.mark.slow  # trains the recipe in real processes
TINY = [
    f"model.arch={SMALL_ARCH}",
    "train.batch_size=6",  # 18 training images: 3 steps an epoch
    "eval.batch_size=4",
    "data.augment.train_size=32",
    "data.augment.eval_resize=36",
    "data.augment.eval_size=32",
    "loader.num_workers=1",  # shards opened in a loader worker
    "log.every_steps=1",
]
SHARD_MB = "data.shard_mb=0.01"  # ~8 images a shard: three training shards, one for val


def make_shards(root, *overrides) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(
            ["imagenet", *QUIET, f"data.root={root}", SHARD_MB, *overrides, "--make-shards"]
        )
    assert code == 0, out.getvalue()
    return out.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = write_image_folder(tmp_path_factory.mktemp("data") / "images")
    make_shards(root)
    return root


def datasets(root, fmt: str):
    return build_datasets(DataConfig(root=str(root), format=fmt, augment=DataConfig().augment))


def test_shards_hold_the_folders_bytes_labels_samples_and_fingerprint(images):
    folder, shards = datasets(images, "folder"), datasets(images, "shards")
    for a, b in zip(folder, shards, strict=True):
        assert len(a) == len(b) and a.classes == b.classes
        for i in range(len(a)):
            assert torch.equal(a.read(i), b.read(i)) and a.labels[i] == b.labels[i]
            seed_sample(1234 + i)
            x, y = a[i]
            seed_sample(1234 + i)
            assert torch.equal(x, b[i][0]) and y == b[i][1]  # augmented alike
        for content in (False, True):
            assert a.fingerprint(content)["sha256"] == b.fingerprint(content)["sha256"]
    assert (
        shards[0].fingerprint()["summary"]
        == f"18 files in 3 classes, {sum(folder[0].sizes)} bytes in 3 shards"
    )
    with tarfile.open(images / "shards" / "train-000000.tar") as tar:  # WebDataset's layout
        assert tar.getnames()[:2] == ["n00000000/n00000000_0.jpeg", "n00000000/n00000000_0.cls"]


def test_a_stopped_make_shards_continues_and_a_partial_shard_is_never_read(images, tmp_path):
    out = tmp_path / "shards"
    first = make_shards(images, f"data.shards={out}")
    written = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    kept_mtime = (out / "train-000001.tar").stat().st_mtime_ns
    # what a run stopped while writing the third training shard leaves: the index removed
    # first, two whole shards, the third half written under its temporary name
    (out / "index.json").unlink()
    (out / "train-000002.tar").unlink()
    (out / "val-000000.tar").unlink()
    (out / ".train-000002.tar.4242.partial").write_bytes(written["train-000002.tar"][:5000])
    # and a whole shard cut short since (a copy that stopped)
    (out / "train-000000.tar").write_bytes(written["train-000000.tar"][:7000])
    with pytest.raises(DataError, match="no shard index at .*make shards RECIPE=imagenet"):
        build_datasets(DataConfig(root=str(images), format="shards", shards=str(out)))

    again = make_shards(images, f"data.shards={out}")
    assert "shard 2/4 train-000001.tar: 9 images" in again and "kept (written before)" in again
    assert [line.endswith("left") and "written;" in line for line in again.splitlines()[1:5]] == [
        True,
        False,
        True,
        True,
    ]
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == written  # byte for byte
    assert (out / "train-000001.tar").stat().st_mtime_ns == kept_mtime  # not rewritten
    assert not list(out.glob(".*")) and (out / "index.json").exists()
    assert first.splitlines()[0] == again.splitlines()[0]


def damaged(images, root, case: str):
    """A copy of the shards with one thing wrong."""
    out = root / case.replace(" ", "-")
    shutil.copytree(images / "shards", out)
    shard = out / "train-000001.tar"
    if case == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:4000])
    elif case == "missing shard":
        shard.unlink()
    elif case == "no index":
        (out / "index.json").unlink()
    elif case == "undecodable sample":  # the same size, garbage where one image's bytes are
        offset = json.loads((out / "index.json").read_text())["splits"]["train"]["offsets"][8]
        with open(shard, "r+b") as f:
            f.seek(offset)
            f.write(b"<html>404</html>" * 8)
    return out


# What the error line names, and the fix it gives
DAMAGE = {
    "truncated shard": ("train-000001.tar is", "rerun `make shards RECIPE=imagenet`"),
    "missing shard": ("train-000001.tar (No such file", "rerun `make shards RECIPE=imagenet`"),
    "no index": ("no shard index at", "make shards RECIPE=imagenet"),
}
RESUMED = [*TINY, "data.format=shards", "train.max_steps=3"]


@pytest.fixture(scope="module")
def command_lines(images, tmp_path_factory, train_here):
    """A run through and the first half of one stopped mid-epoch train in this process; then
    one process of its own runs, one after the other, the second half (reading copies of the
    shards in data.shard_cache, which a resume may switch on), a run over each damaged copy
    of the shards, and digits --make-shards. Returns (run root, damaged folders, calls)."""
    root = tmp_path_factory.mktemp("runs")
    common = [*RESUMED, f"data.root={images}"]
    train_here(root, "whole", *common, recipe="imagenet")
    train_here(root, "halves", *common, "train.stop_at_step=2", recipe="imagenet")
    resume = ["imagenet", *common, f"run.root={root}", "run.name=halves"]
    resume.append(f"data.shard_cache={root / 'node-local'}")
    folders = {case: damaged(images, root, case) for case in [*DAMAGE, "undecodable sample"]}
    argvs = [
        ["imagenet", *TINY, f"run.root={root}", f"run.name={i}", "train.max_steps=3"]
        + ["loader.num_workers=0", f"data.root={images}", "data.format=shards", f"data.shards={f}"]
        for i, f in enumerate(folders[case] for case in DAMAGE)
    ]
    calls = engine_calls(resume, *argvs, ["digits", f"run.root={root}", "--make-shards"])
    return root, folders, calls


def test_a_run_stopped_mid_epoch_resumes_from_node_local_shard_copies_bitwise(
    images, command_lines
):
    root, _, (resumed, *_) = command_lines
    assert resumed.returncode == 0, resumed.stderr
    assert "copied 3 shards" in resumed.stderr and "copied 1 shards" in resumed.stderr
    (copies,) = (root / "node-local").iterdir()
    assert sorted(p.name for p in copies.glob("*.tar")) == sorted(
        p.name for p in (images / "shards").glob("*.tar")
    )
    whole = final_checkpoint(root, "whole", "imagenet")
    halves = final_checkpoint(root, "halves", "imagenet")
    assert same_weights(whole["model"], halves["model"]) and whole["step"] == halves["step"] == 3
    losses = [
        [r["loss"] for r in records(root, n, "train", "imagenet")] for n in ("whole", "halves")
    ]
    assert losses[0] == losses[1] and len(losses[1]) == 3


def test_a_damaged_shard_or_sample_stops_in_one_line_naming_it_and_the_fix(command_lines):
    _, folders, (_, *calls, digits) = command_lines
    for (case, (names, fix)), out in zip(DAMAGE.items(), calls, strict=True):
        folder = folders[case]
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and "Traceback" not in out.stderr, (case, out.stderr)
        assert lines[-1].startswith("error: ") and str(folder) in lines[-1], (case, lines[-1])
        assert names in lines[-1] and fix in lines[-1], (case, lines[-1])
    assert digits.returncode == 2 and "no shard form" in digits.stderr


def test_an_undecodable_sample_from_a_shard_meets_todays_bad_sample_rule(command_lines):
    """It stops the run naming the shard and its file (the engine's one line for an unreadable
    sample: tests/recipes/test_imagenet.py); with data.skip_bad the next readable sample,
    loaded with the bad one's seed, takes its place, counted as replaced."""
    _, folders, _ = command_lines
    cfg = DataConfig(format="shards", shards=str(folders["undecodable sample"]))
    with pytest.raises(
        DataError, match=r"unreadable sample .*train-000001.tar \(n00000001/.*data.skip_bad=true"
    ):
        SeededSamples(build_datasets(cfg)[0])[(8, 77, 0)]
    train = SeededSamples(build_datasets(cfg)[0], skip_bad=True)
    with contextlib.redirect_stderr(io.StringIO()) as warned:
        x, _, index, replaced, _ = train[(8, 77, 0)]
    assert (index, replaced) == (8, 1) and "train-000001.tar (n00000001/" in warned.getvalue()
    assert torch.equal(x, train[(9, 77, 0)].x)


def test_gpu_decoding_with_shards_is_refused_in_one_line(images):
    with pytest.raises(ConfigError, match="data.decode=gpu reads the class folders"):
        build_datasets(DataConfig(root=str(images), format="shards", decode="gpu"))


def test_make_shards_renders_the_engines_command(capsys):
    env = {"RECIPE": "imagenet", "ARGS": "data.root=/data/imagenet", "DRY_RUN": "1"}
    assert launch_cli.main(["shards"], env=env | {"PATH": os.environ["PATH"]}) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith("-m engine.train imagenet data.root=/data/imagenet --make-shards"), line
