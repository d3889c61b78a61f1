"""data.decode=gpu: workers read bytes and draw the crops, the device decodes and augments the
batch. On the CPU it must give bitwise the batches of the per-sample pipeline, through the
real loaders, index and JPEG files (odd and unreadable files included)."""

from pathlib import Path

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F
from torchvision.transforms.v2.functional import _geometry

from bench.jpegs import write_jpeg_folder
from engine.config import ConfigError, LoaderConfig
from engine.data.errors import DataError
from engine.data.loaders import eval_loader, train_loader
from engine.data.sampler import GlobalBatchSampler, plan_batches
from engine.vision.gpu_decode import (
    BILINEAR,
    DeviceDecodedFiles,
    EncodedBatch,
    EncodedImage,
    crop_flip_batch,
    decode_batch,
    resize_centre_crop_batch,
)
from engine.vision.imagefolder import ImageFiles, folder_indexes
from engine.vision.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageAugment,
    TrainTransform,
    eval_transform,
    mean_colour,
)
from tests.datagen_images import (
    SMALL_ARCH,
    jpeg_bytes,
    plant_jpeg,
    plant_not_an_image,
    plant_png_as_jpeg,
    plant_truncated_jpeg,
    settle,
    wnid,
    write_image_folder,
)
from tests.helpers import records, run_engine

CPU = torch.device("cpu")
AUG = ImageAugment(train_size=64, scale_min=0.2, eval_resize=72, eval_size=64)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """3 classes x 8 train and 3 val JPEGs around 120x160, and the odd files of ImageNet."""
    root = write_image_folder(
        tmp_path_factory.mktemp("gpu") / "imagenet", 3, 8, 3, size=(120, 160), seed=7
    )
    plant_png_as_jpeg(root / "train" / wnid(0) / f"{wnid(0)}_1.JPEG")
    plant_jpeg(root / "train" / wnid(1) / f"{wnid(1)}_2.JPEG", "CMYK")
    plant_jpeg(root / "train" / wnid(2) / f"{wnid(2)}_3.JPEG", "L")
    plant_jpeg(next((root / "val" / wnid(1)).iterdir()), "CMYK")
    settle(root)
    return root


def datasets(root: Path, aug: ImageAugment = AUG, train: bool = True):
    """The same split as decode=cpu and decode=gpu datasets."""
    index = folder_indexes(root)[0 if train else 1]
    cpu = ImageFiles(index, TrainTransform(aug) if train else eval_transform(aug))
    return cpu, DeviceDecodedFiles(index, aug, train)


def train_batches(dataset, seed: int, epoch: int, workers: int = 0, skip_bad: bool = False):
    sampler = GlobalBatchSampler(len(dataset), plan_batches(8, 4, 1), rank=0, seed=seed)
    sampler.set_epoch(epoch)
    cfg = LoaderConfig(num_workers=workers, persistent_workers=False)
    return list(train_loader(dataset, sampler, cfg, CPU, skip_bad))


def as_uint8(dataset, batch) -> torch.Tensor:
    if isinstance(batch.x, EncodedBatch):
        return dataset.images_on_device(batch.x, CPU)
    return batch.x


def assert_same_batches(cpu, gpu, cpu_batches, gpu_batches):
    assert len(cpu_batches) == len(gpu_batches) > 0
    for a, b in zip(cpu_batches, gpu_batches, strict=True):
        assert isinstance(b.x, EncodedBatch) and a.x.dtype == torch.uint8
        assert torch.equal(as_uint8(cpu, a), as_uint8(gpu, b))
        assert torch.equal(a.y, b.y) and torch.equal(a.index, b.index)
        assert torch.equal(a.replaced, b.replaced)
        normalised = gpu.finish_on_device(b.x, CPU)
        assert normalised.dtype == torch.float32
        assert torch.equal(normalised, cpu.finish_on_device(a.x, CPU))


@pytest.mark.parametrize("seed, epoch", [(0, 0), (1, 0), (1, 3)])
def test_training_batches_are_bitwise_those_of_cpu_decode(data, seed, epoch):
    cpu, gpu = datasets(data)
    cpu_batches, gpu_batches = train_batches(cpu, seed, epoch), train_batches(gpu, seed, epoch)
    assert_same_batches(cpu, gpu, cpu_batches, gpu_batches)
    decoded_in_worker = sum(d is not None for b in gpu_batches for d in b.x.decoded)
    assert decoded_in_worker == 3  # the PNG, the CMYK and the grey JPEG
    flips = [f for b in gpu_batches for f in b.x.flips]
    assert any(flips) and not all(flips)


def test_a_share_of_the_files_is_decoded_by_the_workers_the_same_files_every_time(data):
    """data.cpu_decode_share: a fixed choice per file, in every epoch and loader order; on
    the CPU both decoders are libjpeg-turbo's, so the batches are those of decode=cpu."""
    index = folder_indexes(data)[0]
    split = DeviceDecodedFiles(index, AUG, train=True, cpu_share=0.5)
    chosen = [i for i in range(len(split)) if split.decoded_in_worker(i)]
    assert 0.25 * len(split) <= len(chosen) <= 0.75 * len(split)
    again = DeviceDecodedFiles(index, AUG, train=True, cpu_share=0.5)
    assert [again.decoded_in_worker(i) for i in range(len(split))] == [
        i in chosen for i in range(len(split))
    ]
    base = DeviceDecodedFiles(index, AUG, train=True)
    not_for_the_device = {i for i in range(len(base)) if base[i][0].data.ndim == 3}
    assert len(not_for_the_device) == 3  # the PNG, CMYK and grey files planted
    batches = train_batches(split, seed=0, epoch=1)
    for batch in batches:
        for i, decoded in zip(batch.index.tolist(), batch.x.decoded, strict=True):
            assert (decoded is not None) == (i in chosen or i in not_for_the_device)
    cpu, _ = datasets(data)
    assert_same_batches(cpu, split, train_batches(cpu, seed=0, epoch=1), batches)
    every = DeviceDecodedFiles(index, AUG, train=True, cpu_share=1.0)
    assert all(every.decoded_in_worker(i) for i in range(len(every)))


def test_a_decode_share_without_decode_gpu_is_refused_in_one_line():
    from recipes.imagenet.data import DataConfig, check_data

    with pytest.raises(ConfigError, match="data.decode=gpu"):
        check_data(DataConfig(cpu_decode_share=0.25, synthetic=True))


def test_with_workers_too_and_other_seeds_give_other_crops(data):
    cpu, gpu = datasets(data)
    gpu_batches = train_batches(gpu, seed=5, epoch=1, workers=2)
    assert_same_batches(cpu, gpu, train_batches(cpu, seed=5, epoch=1), gpu_batches)
    other = train_batches(gpu, seed=6, epoch=1)
    assert [b.x.boxes for b in other] != [b.x.boxes for b in gpu_batches]


def test_progressive_resizing_follows_the_epoch(data):
    aug = ImageAugment(train_size=96, ramp_from_size=32, ramp_end_epoch=2)
    cpu, gpu = datasets(data, aug)
    for epoch, size in ((0, 32), (1, 64), (2, 96)):
        batches = train_batches(gpu, seed=2, epoch=epoch, workers=0)
        assert_same_batches(cpu, gpu, train_batches(cpu, seed=2, epoch=epoch), batches)
        assert as_uint8(gpu, batches[0]).shape[-2:] == (size, size)


def test_eval_batches_are_bitwise_those_of_cpu_decode(data):
    cpu, gpu = datasets(data, train=False)
    cfg = LoaderConfig(num_workers=0)
    cpu_batches, gpu_batches = (list(eval_loader(d, 4, 0, 1, cfg, CPU)) for d in (cpu, gpu))
    assert_same_batches(cpu, gpu, cpu_batches, gpu_batches)
    assert sum(len(b.y) for b in gpu_batches) == 9
    assert all(b.x.boxes == [None] * len(b.x) for b in gpu_batches)


def test_unreadable_files_are_skipped_in_the_worker_as_with_cpu_decode(tmp_path):
    root = write_image_folder(tmp_path / "imagenet", 2, 8, 1, size=(60, 80))
    plant_not_an_image(root / "train" / wnid(0) / f"{wnid(0)}_2.JPEG")
    plant_truncated_jpeg(root / "train" / wnid(1) / f"{wnid(1)}_5.JPEG")
    settle(root)
    cpu, gpu = datasets(root)
    gpu_batches = train_batches(gpu, 3, 0, skip_bad=True)
    cpu_batches = train_batches(cpu, 3, 0, skip_bad=True)
    assert_same_batches(cpu, gpu, cpu_batches, gpu_batches)
    assert sum(int(b.replaced.sum()) for b in gpu_batches) == 2
    with pytest.raises(DataError, match=r"unreadable sample .*(00_2|01_5)\.JPEG: .*skip_bad=true"):
        train_batches(gpu, 3, 0)


def plant_bad_huffman_table(path: Path) -> Path:
    """A JPEG whose header (and size) reads, but whose data does not decode."""
    data = bytearray(jpeg_bytes(size=(60, 80), seed=5))
    data[data.index(b"\xff\xc4") + 4] = 0x77  # a Huffman table index that does not exist
    path.write_bytes(bytes(data))
    return path


def test_a_file_failing_on_the_device_stops_with_one_line_naming_it(tmp_path):
    root = write_image_folder(tmp_path / "imagenet", 2, 4, 1, size=(60, 80))
    bad = plant_bad_huffman_table(root / "train" / wnid(1) / f"{wnid(1)}_0.JPEG")
    settle(root)
    _, gpu = datasets(root)
    with pytest.raises(DataError) as err:
        for batch in train_batches(gpu, 0, 0, skip_bad=True):
            gpu.finish_on_device(batch.x, CPU)
    message = str(err.value)
    assert "\n" not in message and str(bad) in message and "Bogus DHT index" in message
    assert "skip_bad cannot" in message and "data.decode=cpu" in message


def test_the_device_normalises_as_to_dtype_and_normalize_did_and_erasing_is_the_mean(data):
    erasing = TrainTransform(ImageAugment(train_size=64, random_erasing=1.0))
    cpu = ImageFiles(folder_indexes(data)[0], erasing)
    (batch, *_) = train_batches(cpu, seed=0, epoch=0)
    x = batch.x
    reference = v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)(v2.ToDtype(torch.float32, scale=True)(x))
    assert torch.allclose(cpu.finish_on_device(x, CPU), reference, atol=1e-5)
    erased = (x == torch.tensor(mean_colour(IMAGENET_MEAN)).view(1, 3, 1, 1)).all(1)
    assert erased.flatten(1).sum(1).min() >= 0.02 * 64 * 64  # RandomErasing's smallest area
    assert cpu.finish_on_device(x, CPU).permute(0, 2, 3, 1)[erased].abs().max() < 0.01


@pytest.mark.parametrize("option", [{"trivial_augment": True}, {"random_erasing": 0.25}])
def test_per_sample_cpu_augmentations_are_refused(data, option):
    index = folder_indexes(data)[0]
    with pytest.raises(ConfigError, match="data.decode=gpu cannot apply") as err:
        DeviceDecodedFiles(index, ImageAugment(**option), train=True)
    assert "\n" not in str(err.value)
    DeviceDecodedFiles(index, ImageAugment(**option), train=False)  # evaluation does neither


def blurred(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.avg_pool2d(x.float(), 4)


def torchvision_per_image(data, x: EncodedBatch, device, images=None) -> torch.Tensor:
    """The augmentation as torchvision's functions take it, image by image (decode=gpu
    before its batching): uint8 NCHW."""
    images = decode_batch(x, device) if images is None else images
    if not data.train:
        return torch.stack([data.transform(im) for im in images])
    out = []
    for image, box, flip in zip(images, x.boxes, x.flips, strict=True):
        image = F.resized_crop(image, *box, [x.size, x.size], BILINEAR, antialias=True)
        out.append(F.horizontal_flip(image) if flip else image)
    return torch.stack(out)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Real ImageNet-sized photographs: resizes by large factors, in both directions."""
    root = tmp_path_factory.mktemp("photos") / "imagenet"
    return write_jpeg_folder(root, classes=2, train_per_class=8, val_per_class=4)


def whole_batch(root: Path, train: bool, aug: ImageAugment | None = None):
    aug = aug or ImageAugment()
    data = DeviceDecodedFiles(folder_indexes(root)[0 if train else 1], aug, train)
    samples = []
    for i in range(len(data)):
        torch.default_generator.manual_seed(i)
        samples.append(data[i][0])
    return data, EncodedImage.collate(samples)


def batched(data, x: EncodedBatch, images, in_float: bool) -> torch.Tensor:
    if data.train:
        return crop_flip_batch(images, x.boxes, x.flips, x.size, in_float)
    return resize_centre_crop_batch(images, data.transform, data.cfg, in_float)


@pytest.mark.parametrize("train", [True, False])
def test_the_batched_float_path_is_torchvision_s_float_path_within_a_level_of_the_cpu(
    photos, train, monkeypatch
):
    """CUDA's path, run on the CPU: the batch resampled at once is torchvision's per-image
    uint8 -> float -> resize -> round -> uint8 (its path on CUDA, and on CPUs without its
    uint8 kernel) within one level in a few values per million (another order of sums:
    tests/engine/vision/test_resample.py). Against the CPU's uint8 kernel (decode=cpu on this
    machine) it differs by at most one level, in about one value in eight (measured 13.5%
    train, 13.0% eval on these photos)."""
    data, x = whole_batch(photos, train)
    images = decode_batch(x, CPU)
    in_float = batched(data, x, images, in_float=True)
    assert in_float.dtype == torch.float32 and torch.equal(in_float, in_float.round())
    cpu_kernel = data.images_on_device(x, CPU)
    assert torch.equal(cpu_kernel, torchvision_per_image(data, x, CPU, images))
    with monkeypatch.context() as patched:
        patched.setattr(_geometry, "_do_native_uint8_resize_on_cpu", lambda *_: False)
        reference = torchvision_per_image(data, x, CPU, images)
    to_float = (in_float - reference.float()).abs()
    assert to_float.max() <= 1 and (to_float > 0).float().mean() < 1e-4
    diff = (in_float - cpu_kernel.float()).abs()
    differ = (diff > 0).float().mean().item()
    print(f"float path against the CPU's uint8 kernel: max {diff.max():.0f}, {differ:.1%} differ")
    assert diff.max() <= 1 and differ < 0.25


def test_flips_and_crops_that_need_no_resize_in_the_float_path(photos):
    """A crop already of the output size is copied as torchvision returns it; all, none or
    some flips; an eval crop larger than the resized image is padded as CenterCrop does."""
    data, x = whole_batch(photos, train=True, aug=ImageAugment(train_size=64))
    images = decode_batch(x, CPU)
    n = len(images)
    boxes = [(3, 5, 64, 64)] * n  # the output size: no resize
    for flips in ([True] * n, [False] * n, [k % 3 == 0 for k in range(n)]):
        x.boxes, x.flips = boxes, flips
        assert torch.equal(
            crop_flip_batch(images, boxes, flips, 64, in_float=True).to(torch.uint8),
            torchvision_per_image(data, x, CPU, images),
        )
    aug = ImageAugment(eval_resize=48, eval_size=64)  # pads
    data, x = whole_batch(photos, train=False, aug=aug)
    images = decode_batch(x, CPU)[:2]
    padded = resize_centre_crop_batch(images, data.transform, aug, in_float=True)
    assert torch.equal(padded.to(torch.uint8), torch.stack([data.transform(i) for i in images]))


@pytest.mark.gpu  # nvJPEG needs a CUDA device
def test_on_cuda_the_batch_is_pinned_decoded_by_nvjpeg_and_close_to_cpu_decode(tmp_path):
    root = write_jpeg_folder(tmp_path / "photos", classes=2, train_per_class=8, val_per_class=1)
    cpu, gpu = datasets(root, ImageAugment(train_size=128))
    cuda = torch.device("cuda")
    for a, b in zip(train_batches(cpu, 4, 0), train_batches(gpu, 4, 0), strict=True):
        pinned = b.x.pin_memory()
        assert pinned.encoded.is_pinned()
        on_cuda = gpu.images_on_device(pinned, cuda)
        assert on_cuda.device.type == "cuda" and on_cuda.dtype == torch.uint8
        # nvJPEG's IDCT, chroma upsampling and the float resize round differently from the
        # CPU's: close after a blur, where another crop or a missed flip is far off
        assert (blurred(on_cuda.cpu()) - blurred(a.x)).abs().mean() < 3
        assert gpu.finish_on_device(pinned, cuda).dtype == torch.float32


@pytest.mark.slow
def test_trains_and_evaluates_through_the_engine_with_decode_gpu(tmp_path, train_here):
    root = write_image_folder(tmp_path / "imagenet")
    plant_png_as_jpeg(root / "train" / wnid(2) / f"{wnid(2)}_1.JPEG")
    settle(root)
    tiny = [f"model.arch={SMALL_ARCH}", "train.batch_size=6", "eval.batch_size=4"]
    tiny += ["data.augment.train_size=32", "data.augment.eval_resize=36"]
    tiny += ["data.augment.eval_size=32", "loader.num_workers=2", "train.max_steps=3"]
    gpu = [*tiny, f"data.root={root}", "data.decode=gpu"]
    train_here(tmp_path, "gpu", *gpu, recipe="imagenet")  # tests/engine/conftest.py
    (evaluation,) = records(tmp_path, "gpu", "eval", "imagenet")
    assert evaluation["count"] == 6
    refused = run_engine(
        tmp_path,
        "refused",
        *tiny,
        f"data.root={root}",
        "data.decode=gpu",
        "data.augment.trivial_augment=true",
        recipe="imagenet",
        check=False,
    )
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "data.decode=gpu" in lines[0]
