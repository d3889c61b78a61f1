"""engine.vision.resample: a batch of differently sized images cropped, resized, flipped and
cut to one size at once. It is torchvision's per-image float path within one level in a few
values per million (measured on the photographs below, 2026-12-05: 6.6 per million for
training crops, 5.0 for evaluation, bilinear and bicubic), and the number of operations it
runs does not grow with the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as F

from bench.jpegs import write_jpeg_folder
from engine.vision import resample
from engine.vision.gpu_decode import (
    DeviceDecodedFiles,
    EncodedImage,
    crop_flip_batch,
    decode_batch,
    resize_centre_crop_batch,
)
from engine.vision.imagefolder import folder_indexes
from engine.vision.images import ImageAugment

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Real ImageNet-sized photographs: crops shrunk and enlarged by large factors."""
    root = tmp_path_factory.mktemp("photos") / "imagenet"
    return write_jpeg_folder(root, classes=2, train_per_class=8, val_per_class=4)


def decoded(root: Path, train: bool, aug: ImageAugment):
    data = DeviceDecodedFiles(folder_indexes(root)[0 if train else 1], aug, train)
    samples = []
    for i in range(len(data)):
        torch.default_generator.manual_seed(i)
        samples.append(data[i][0])
    x = EncodedImage.collate(samples)
    return data, x, decode_batch(x, CPU)


def per_image(images, boxes, flips, size: int, mode: InterpolationMode) -> torch.Tensor:
    """torchvision's float path image by image, rounded as its uint8 round trip does."""
    out = []
    for image, box, flip in zip(images, boxes, flips, strict=True):
        crop = F.resized_crop(image.float(), *box, [size, size], mode, antialias=True)
        out.append(F.horizontal_flip(crop) if flip else crop)
    return torch.stack(out).round_().clamp_(0, 255)


def per_image_eval(images, aug: ImageAugment) -> torch.Tensor:
    mode = InterpolationMode(aug.interpolation)
    out = [
        F.center_crop(F.resize(im.float(), [aug.eval_resize], mode, antialias=True), aug.eval_size)
        for im in images
    ]
    return torch.stack(out).round_().clamp_(0, 255)


def close(batch: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of values that differ; fails where any differs by more than one level."""
    assert batch.shape == reference.shape and torch.equal(batch, batch.round())
    diff = (batch - reference).abs()
    assert diff.max() <= 1
    return (diff > 0).float().mean().item()


@pytest.mark.slow  # real photographs, resampled twice
def test_training_crops_are_torchvisions_within_a_level(photos):
    data, x, images = decoded(photos, True, ImageAugment())
    assert any(x.flips) and not all(x.flips)
    scales = [box[2] / x.size for box in x.boxes]
    assert min(scales) < 1 < max(scales)  # enlarged and shrunk crops both
    batch = crop_flip_batch(images, x.boxes, x.flips, x.size, in_float=True)
    reference = per_image(images, x.boxes, x.flips, x.size, InterpolationMode.BILINEAR)
    assert close(batch, reference) < 1e-4


@pytest.mark.slow  # real photographs, resampled twice
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_evaluation_windows_are_torchvisions_within_a_level(photos, mode):
    aug = ImageAugment(interpolation=mode)
    data, x, images = decoded(photos, False, aug)
    batch = resize_centre_crop_batch(images, data.transform, aug, in_float=True)
    assert close(batch, per_image_eval(images, aug)) < 1e-4


@pytest.mark.slow  # real photographs, resampled twice
def test_a_batch_resampled_in_parts_is_the_batch_resampled_at_once(photos, monkeypatch):
    data, x, images = decoded(photos, True, ImageAugment())
    whole = crop_flip_batch(images, x.boxes, x.flips, x.size, in_float=True)
    monkeypatch.setattr(resample, "PART_BYTES", 1)  # one sample per part
    assert torch.equal(crop_flip_batch(images, x.boxes, x.flips, x.size, in_float=True), whole)


def test_boxes_at_the_edges_and_of_the_output_size_are_copied_exactly():
    """A box already of the output size is the source's pixels (scale 1: torch's weights are
    1 and 0), at every corner of the image, mirrored or not."""
    torch.manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in [(40, 50), (32, 32)]]
    boxes = [(0, 0, 32, 32), (0, 0, 32, 32)]
    boxes = [(8, 18, 32, 32), (0, 0, 32, 32)]
    for flips in ([False, False], [True, False], [True, True]):
        batch = crop_flip_batch(images, boxes, flips, 32, in_float=True)
        expected = per_image(images, boxes, flips, 32, InterpolationMode.BILINEAR)
        assert torch.equal(batch, expected)
        assert torch.equal(batch[1, :, :, 0], images[1][:, :, -1 if flips[1] else 0].float())


class CountOps(TorchDispatchMode):
    """The operations that compute (views left out): kernels, on a device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("train", [True, False])
def test_the_operations_per_batch_do_not_grow_with_the_batch(photos, train):
    """The same images four times over: the same taps, four times the samples. A loop over
    the images (decode=gpu's path before) ran about 2 operations per image here."""
    aug = ImageAugment()
    data, x, images = decoded(photos, train, aug)
    images, boxes, flips = images[:4], x.boxes[:4], x.flips[:4]
    counts = []
    for times in (1, 4):
        with CountOps() as ops:
            if train:
                crop_flip_batch(images * times, boxes * times, flips * times, x.size, True)
            else:
                resize_centre_crop_batch(images * times, data.transform, aug, True)
        counts.append(ops.count)
    print(f"operations per batch of 4 and of 16: {counts}")
    assert counts[0] == counts[1]
