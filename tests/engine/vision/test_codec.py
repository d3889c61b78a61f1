"""The image decoders (engine.vision.codec, torchcodec): the pixels torchvision's deprecated
decoders gave for the same bytes, bitwise, so runs from before the switch resume unchanged; and
a site image without torchcodec stops in one line. No test may reach torchvision's decoders
outside `torchvision_reference` (pyproject's filterwarnings makes their warning an error)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.data.errors import BadSample
from engine.vision import codec
from recipes.imagenet.example import picture
from tests.datagen_images import SMALL_ARCH, write_image_folder
from tests.helpers import REPO, engine_env, run_dir, run_engine


def torchvision_reference(data: torch.Tensor) -> torch.Tensor:
    """What the engine's decode_rgb returned before the switch (torchvision 0.29)."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as F

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        image = decode_image(data, mode=ImageReadMode.RGB)
    return F.to_dtype(image, torch.uint8, scale=True) if image.dtype != torch.uint8 else image


def photo(seed: int, size=(181, 243)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return picture(rng, rng.uniform(0, 255, 3), size)


def encoded(image: Image.Image, fmt: str, **options) -> torch.Tensor:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


KINDS = {
    "jpeg 4:2:0 q75": lambda: encoded(photo(0), "JPEG", quality=75, subsampling=2),
    "jpeg 4:2:2 q90": lambda: encoded(photo(1), "JPEG", quality=90, subsampling=1),
    "jpeg 4:4:4 q95": lambda: encoded(photo(2), "JPEG", quality=95, subsampling=0),
    "jpeg progressive": lambda: encoded(photo(3), "JPEG", progressive=True),
    "jpeg odd size": lambda: encoded(photo(4, (37, 91)), "JPEG"),
    "grey jpeg": lambda: encoded(photo(5).convert("L"), "JPEG"),
    "cmyk jpeg": lambda: encoded(photo(6).convert("CMYK"), "JPEG"),
    "png": lambda: encoded(photo(7), "PNG"),
    "palette png": lambda: encoded(photo(8).convert("P"), "PNG"),
    "16-bit png": lambda: encoded(
        Image.fromarray(np.random.default_rng(9).integers(0, 65536, (23, 31), dtype=np.uint16)),
        "PNG",
    ),
    "webp lossless": lambda: encoded(photo(10), "WEBP", lossless=True),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_rgb_gives_torchvisions_pixels_bitwise(kind):
    data = KINDS[kind]()
    image = codec.decode_rgb(data, "x")
    assert image.dtype == torch.uint8 and image.ndim == 3 and image.shape[0] == 3
    assert torch.equal(image, torchvision_reference(data))


def test_a_batch_of_jpegs_decodes_as_each_alone():
    files = [KINDS[k]() for k in ("jpeg 4:2:0 q75", "jpeg 4:4:4 q95", "jpeg odd size")]
    batch = codec.decode_jpegs(files, torch.device("cpu"))
    assert len(batch) == 3
    for data, image in zip(files, batch, strict=True):
        assert torch.equal(image, codec.decode_rgb(data, "x"))


@pytest.mark.parametrize(
    "payload", [b"", b"<html>404</html>", None], ids=["empty", "not an image", "truncated"]
)
def test_undecodable_bytes_are_a_bad_sample_with_a_plain_reason(payload):
    data = (
        KINDS["png"]()[:300] if payload is None else torch.tensor(list(payload), dtype=torch.uint8)
    )
    with pytest.raises(BadSample) as err:
        codec.decode_rgb(data, "a/b.JPEG")
    assert err.value.path == "a/b.JPEG"
    assert err.value.reason and ".cpp" not in err.value.reason and "\n" not in err.value.reason


def test_read_bytes_reads_the_whole_file_or_names_why_not(tmp_path):
    path = tmp_path / "f.JPEG"
    path.write_bytes(bytes(range(256)) * 3)
    assert codec.read_bytes(str(path)).tolist() == list(range(256)) * 3
    with pytest.raises(BadSample, match="No such file"):
        codec.read_bytes(str(tmp_path / "gone.JPEG"))


@pytest.mark.slow
def test_without_torchcodec_an_image_recipe_stops_in_one_line(tmp_path):
    """A site image with torch but not torchcodec: one line naming the package and its pin,
    before any loader worker starts; no checkpoint written."""
    blocker = tmp_path / "site" / "torchcodec"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named torchcodec')\n")
    root = write_image_folder(tmp_path / "imagenet")
    out = run_engine(
        tmp_path / "runs",
        "no-codec",
        f"model.arch={SMALL_ARCH}",
        "train.max_steps=1",
        f"data.root={root}",
        recipe="imagenet",
        check=False,
        env=engine_env(PYTHONPATH=f"{blocker.parent}:{REPO}"),
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and codec.TORCHCODEC_PIN in lines[0] and "Traceback" not in out.stderr
    checkpoints = run_dir(tmp_path / "runs", "no-codec", "imagenet") / "checkpoints"
    assert not list(checkpoints.glob("step-*"))


def test_the_pin_named_in_the_error_is_the_locks():
    lock = (REPO / "requirements.lock").read_text().splitlines()
    assert codec.TORCHCODEC_PIN in lock


def test_nothing_in_the_project_calls_torchvisions_decoders():
    """The deprecated decoders, named anywhere but this test file's reference."""
    found = [
        f"{path.relative_to(REPO)}"
        for folder in ("engine", "recipes", "launch", "bench")
        for path in Path(REPO, folder).rglob("*.py")
        if "torchvision.io" in path.read_text()
    ]
    assert found == []
