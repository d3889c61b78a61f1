"""JPEG decoding on the training device (`data.decode: gpu`): the loader workers only read each
file's bytes, take its size from the header and draw the sample's augmentation; the training
device decodes the whole batch at once (torchcodec's decode_jpeg: nvJPEG on CUDA), then
crops, resizes, flips and normalises it there. On CUDA, with loader workers, that is done for
the next batches while the step runs, by a thread on a stream of its own (engine.data.prefetch,
loader.decode_ahead).

The augmentation is drawn with the CPU pipeline's own RNG calls (RandomResizedCrop's
make_params, then the flip's draw), and applied with the same functions, so on the CPU the
batches are bitwise those of `decode: cpu` for the same seeds.

On CUDA the batch is augmented at once, with the arithmetic torchvision uses there image by
image: torchvision resizes a uint8 image on CUDA by converting it to float32, resizing
(antialiased), rounding and converting back. Here the whole batch is cropped, resized, flipped
and cut to its window in float32 by engine.vision.resample (torch's filters and weights, in
a number of operations that does not grow with the batch), rounded, and normalised without
the trip through uint8. Its sums run in another order than torch's per-image kernel, so it
differs from torchvision's per-image float result by at most one level in a few values per
million (measured: tests/engine/vision/test_resample.py). What differs from `decode: cpu`:
nvJPEG's IDCT and chroma upsampling round differently from libjpeg-turbo, and the CPU resizes
uint8 with its own integer kernel (AVX2, AVX-512, ARM); on the same decoded pixels the float
resize differs from that kernel by at most one level (of 255), in about 13% of the values
(measured on photographs, training crops and evaluation alike:
tests/engine/vision/test_gpu_decode.py). The CPU keeps torchvision's per-image call.

Files the device is not given: whatever PIL's header does not show as a colour JPEG (PNGs
named .JPEG, CMYK and grey JPEGs) and JPEGs without their end marker (truncated,
most likely) are decoded in the worker as `decode: cpu` does, and travel decoded in the same
batch; unreadable files raise BadSample there, so data.skip_bad works as with `decode: cpu`.
A file whose header reads but whose body fails on the device stops the run with a DataError
naming it: by then the batch has left the loader, and skip_bad cannot replace the file."""

from __future__ import annotations

import dataclasses
import functools
import io
from dataclasses import dataclass

import torch
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as F

from engine.config import ConfigError
from engine.data.errors import DataError
from engine.data.stages import STAGES, sample_stage
from engine.vision import resample
from engine.vision.codec import decode_jpegs, decode_rgb, error_reason, read_bytes
from engine.vision.imagefolder import FolderIndex, ImageFiles
from engine.vision.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageAugment,
    TrainTransform,
    eval_transform,
    interpolation,
    normalise_on_device,
)

BILINEAR = InterpolationMode.BILINEAR  # RandomResizedCrop's here: check_augment refuses others

END_OF_IMAGE = b"\xff\xd9"


def device_jpeg_size(data: torch.Tensor) -> tuple[int, int] | None:
    """(height, width) of a colour JPEG ending in its end marker, read from its header; None
    for any other file (the worker decodes those)."""
    raw = data.numpy().tobytes()
    if not raw.endswith(END_OF_IMAGE):  # truncated: the CPU decoder names the problem
        return None
    try:
        with Image.open(io.BytesIO(raw)) as header:
            if header.format == "JPEG" and header.mode == "RGB":
                return header.height, header.width
    except Exception:  # noqa: BLE001 - any header PIL cannot read: decode_rgb decides
        pass
    return None


@dataclass
class EncodedImage:
    """One sample as a worker leaves it: the file's bytes (1-D uint8) or, for a file the
    device is not given, the image decoded in the worker (uint8 (3, H, W)); the crop box
    (top, left, height, width) and flip drawn for it (training); the output side."""

    data: torch.Tensor
    path: str
    box: tuple[int, int, int, int] | None
    flip: bool
    size: int

    @staticmethod
    def collate(images: list[EncodedImage]) -> EncodedBatch:
        return EncodedBatch.collate(images)


@dataclass
class EncodedBatch:
    """A batch of EncodedImages. The JPEG files' bytes are concatenated into one tensor: one
    shared-memory block from the worker and one pinned buffer, not one per file."""

    encoded: torch.Tensor  # the bytes of the files the device decodes, in batch order
    lengths: list[int]  # per file in `encoded`
    decoded: list[torch.Tensor | None]  # per sample: decoded in the worker, or None
    paths: list[str]
    boxes: list[tuple[int, int, int, int] | None]
    flips: list[bool]
    size: int

    @staticmethod
    def collate(images: list[EncodedImage]) -> EncodedBatch:
        sizes = {im.size for im in images}
        if len(sizes) != 1:
            raise ValueError(f"one batch holds samples of output sizes {sorted(sizes)}")
        files = [im.data for im in images if im.data.ndim == 1]
        return EncodedBatch(
            encoded=torch.cat(files) if files else torch.empty(0, dtype=torch.uint8),
            lengths=[len(f) for f in files],
            decoded=[None if im.data.ndim == 1 else im.data for im in images],
            paths=[im.path for im in images],
            boxes=[im.box for im in images],
            flips=[im.flip for im in images],
            size=sizes.pop(),
        )

    def __len__(self) -> int:
        return len(self.paths)

    def pin_memory(self) -> EncodedBatch:
        """For the DataLoader's pin_memory: the copies to the device become asynchronous."""
        return dataclasses.replace(
            self,
            encoded=self.encoded.pin_memory(),
            decoded=[None if d is None else d.pin_memory() for d in self.decoded],
        )

    def files(self) -> list[torch.Tensor]:
        """Each encoded file's bytes, as views of `encoded`."""
        return list(torch.split(self.encoded, self.lengths)) if self.lengths else []


def decode_batch(batch: EncodedBatch, device: torch.device) -> list[torch.Tensor]:
    """Every image of the batch, uint8 (3, H, W) on the device, in batch order."""
    on_device = [k for k, d in enumerate(batch.decoded) if d is None]
    images = [None if d is None else d.to(device, non_blocking=True) for d in batch.decoded]
    if on_device:
        files = batch.files()
        try:
            decoded = _decode_jpegs(files, device)
        except (RuntimeError, ValueError) as err:
            raise _failed_file(files, [batch.paths[k] for k in on_device], device, err) from None
        for k, image in zip(on_device, decoded, strict=True):
            images[k] = image
    return images


def _decode_jpegs(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type != "cuda":
        return decode_jpegs(files, device)
    # torchvision's CUDA decoder wrote from a private stream into memory allocated on the
    # current stream without waiting for it (pytorch/vision#9606); torchcodec's documents no
    # stream contract either. A block the last step freed while its kernels still read it could
    # be overwritten. Allocated on a stream of its own, which runs no kernels, it only gets
    # blocks nothing reads any more; record_stream keeps them so until the training stream is
    # done with them.
    main, side = torch.cuda.current_stream(device), _decode_stream(device)
    with torch.cuda.stream(side):
        images = decode_jpegs(files, device)
    main.wait_stream(side)
    for image in images:
        image.record_stream(main)
    return images


@functools.cache
def _decode_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _failed_file(files, paths, device, err: Exception) -> Exception:
    """The batch failed as a whole: decode it one by one to name the file."""
    for data, path in zip(files, paths, strict=True):
        try:
            _decode_jpegs([data], device)
        except (RuntimeError, ValueError) as one:
            reason = error_reason(one)
            return DataError(
                f"unreadable sample {path}: {reason} (decoding on {device}); replace or delete "
                "the file, or set data.decode=cpu (with decode=gpu, data.skip_bad cannot skip "
                "a file whose header reads but whose data does not decode)"
            )
    return err  # each file decodes alone: not a file's fault


def check_augment(cfg: ImageAugment) -> None:
    """The augmentations this path cannot apply, refused in one line."""
    if cfg.trivial_augment or cfg.random_erasing > 0:
        raise ConfigError(
            "data.decode=gpu cannot apply data.augment.trivial_augment or random_erasing "
            "(they need per-sample work on the CPU): turn them off or set data.decode=cpu"
        )
    if cfg.interpolation != "bilinear":
        raise ConfigError(
            f"data.decode=gpu resizes bilinearly, not data.augment.interpolation="
            f"{cfg.interpolation}: set data.decode=cpu (or data.augment.follow_weights=false)"
        )


class DeviceDecodedFiles(ImageFiles):
    """An ImageFiles whose samples are EncodedImages (train: with their crop and flip drawn;
    eval: none), decoded and augmented on the device by finish_on_device."""

    finishes_ahead = True  # worth a thread and stream of its own (engine.data.prefetch)

    def __init__(
        self,
        index: FolderIndex,
        cfg: ImageAugment,
        train: bool,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        cpu_share: float = 0.0,
    ):
        if train:
            check_augment(cfg)
        if not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"cpu_share must be within [0, 1], not {cpu_share}")
        transform = TrainTransform(cfg, mean, std) if train else eval_transform(cfg)
        super().__init__(index, transform, mean, std)
        self.cfg, self.train, self.cpu_share = cfg, train, cpu_share

    def __getitem__(self, i: int) -> tuple[EncodedImage, int]:
        path = self.path(i)
        with sample_stage("read"):
            data = read_bytes(path)
        size = None if self.decoded_in_worker(i) else device_jpeg_size(data)
        if size is None:
            with sample_stage("decode"):
                data = decode_rgb(data, path)
            size = tuple(data.shape[-2:])
        box, flip, out = None, False, self.cfg.eval_size
        if self.train:
            box, flip = self._draw(size)
            out = self.transform.size
        return EncodedImage(data, path, box, flip, out), int(self.labels[i])

    def decoded_in_worker(self, i: int) -> bool:
        """Whether file i is one of the cpu_share the workers decode: a fixed choice per
        file (a hash of its index), so the same files in every epoch, run and world size."""
        return _unit_hash(i) < self.cpu_share

    def _draw(self, size: tuple[int, int]) -> tuple[tuple[int, int, int, int], bool]:
        """The crop and flip TrainTransform would draw for an image of this size: the same
        calls on torch's RNG, in the same order (make_params only reads the size)."""
        stand_in = torch.empty(()).expand(3, *size)  # no memory: stride 0
        p = self.transform.crop.make_params([stand_in])
        # RandomHorizontalFlip flips unless torch.rand(1) >= p (0.5), so only with hflip
        flip = self.cfg.hflip and bool(torch.rand(1) < 0.5)
        return (p["top"], p["left"], p["height"], p["width"]), flip

    def images_on_device(self, x: EncodedBatch, device: torch.device) -> torch.Tensor:
        """The batch decoded and augmented: uint8 NCHW on the device."""
        images = self._augmented(x, device)
        return images if images.dtype == torch.uint8 else images.to(torch.uint8)

    def finish_on_device(self, x: EncodedBatch, device: torch.device) -> torch.Tensor:
        """The batch decoded, augmented and normalised: float32 NCHW on the device."""
        return normalise_on_device(self._augmented(x, device), device, self.mean, self.std)

    def _augmented(self, x: EncodedBatch, device: torch.device) -> torch.Tensor:
        """uint8 NCHW (the CPU), or float32 NCHW holding the same whole levels 0..255 (CUDA:
        normalised without a round trip through uint8)."""
        with STAGES.timing("decode"):
            images = decode_batch(x, device)
        with STAGES.timing("augment"):
            if self.train:
                return crop_flip_batch(images, x.boxes, x.flips, x.size)
            return resize_centre_crop_batch(images, self.transform, self.cfg)


def _unit_hash(i: int) -> float:
    """i spread evenly over [0, 1) (Knuth's multiplicative hash): neighbouring files, often
    of one class, fall far apart."""
    return (i * 2654435761 % 2**32) / 2**32


def resizes_in_float(device: torch.device) -> bool:
    """Where the batched float path runs: wherever torchvision's bilinear resize of a uint8
    image goes through float32 anyway (CUDA). The CPU keeps torchvision's own per-image call
    (its uint8 kernel where the CPU has one), so that decode=gpu there is decode=cpu bitwise."""
    return device.type != "cpu"


def crop_flip_batch(
    images: list[torch.Tensor], boxes, flips: list[bool], size: int, in_float: bool | None = None
) -> torch.Tensor:
    """What RandomResizedCrop(size, antialias=True) and the flip do to each image with its
    drawn box and flip, for the whole batch. in_float (default: resizes_in_float): the batch
    resampled at once in float32 (engine.vision.resample: a number of operations that does not
    grow with the batch), rounded to whole levels as torchvision's uint8 -> float -> resize ->
    round does per image; else torchvision's own call per image (uint8 NCHW)."""
    if not images:
        raise ValueError("an empty batch")
    in_float = resizes_in_float(images[0].device) if in_float is None else in_float
    if not in_float:
        crops = [
            F.resized_crop(im, *box, size=[size, size], interpolation=BILINEAR, antialias=True)
            for im, box in zip(images, boxes, strict=True)
        ]
        return _flip(torch.stack(crops), flips)
    flat, layout, sizes = resample.pack(images)
    geometry = resample.training_geometry(layout, sizes, boxes, flips, size)
    return resample.resample(flat, geometry, size, "bilinear")


def resize_centre_crop_batch(
    images: list[torch.Tensor], transform, cfg: ImageAugment, in_float: bool | None = None
) -> torch.Tensor:
    """eval_transform(cfg) (resize the shorter side, centre crop) on each image, for the
    whole batch. in_float (default: resizes_in_float): resampled at once in float32, only the
    centre window computed, rounded to whole levels; a batch where some image would be padded
    (resized below the crop) or another interpolation takes torchvision's steps per image."""
    if not images:
        raise ValueError("an empty batch")
    device = images[0].device
    in_float = resizes_in_float(device) if in_float is None else in_float
    if not in_float:
        return torch.stack([transform(im) for im in images])  # resize, centre crop: no draws
    mode, size = interpolation(cfg).value, cfg.eval_size
    if mode in resample.SUPPORT:
        flat, layout, sizes = resample.pack(images)
        geometry = resample.evaluation_geometry(layout, sizes, cfg.eval_resize, size)
        if geometry is not None:
            return resample.resample(flat, geometry, size, mode)
    batch = torch.empty(len(images), 3, size, size, dtype=torch.float32, device=device)
    for k, image in enumerate(images):
        resized = F.resize(image.float(), [cfg.eval_resize], interpolation(cfg), antialias=True)
        if min(resized.shape[-2:]) < size:  # the crop would pad: torchvision's own steps
            resized = transform(image)
        batch[k].copy_(F.center_crop(resized, [size, size]))
    return _whole_levels(batch)


def _whole_levels(batch: torch.Tensor) -> torch.Tensor:
    """What torchvision's conversion back to uint8 after its float resize keeps: rounded (half
    to even, as its round_), in 0..255 (its clamp for bicubic; a no-op for bilinear, whose
    weights are >= 0 and sum to 1)."""
    return batch.round_().clamp_(0, 255)


def _flip(batch: torch.Tensor, flips: list[bool]) -> torch.Tensor:
    """The samples drawn to flip, mirrored, in one pass over the batch."""
    if not any(flips):
        return batch
    if all(flips):
        return batch.flip(-1)
    mask = torch.tensor(flips, dtype=torch.bool)
    if batch.device.type == "cuda":  # pinned: the copy does not wait for the stream
        mask = mask.pin_memory()
    mask = mask.to(batch.device, non_blocking=True).view(-1, 1, 1, 1)
    return torch.where(mask, batch.flip(-1), batch)
