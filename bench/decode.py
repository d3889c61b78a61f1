"""Decode + augment throughput per loader worker: PIL against torchvision's tensor path.

One process, one thread (a loader worker's share of a core), on real ImageNet-sized JPEG
photos (bench.jpegs). Every path gets the same per-sample seeds, so the same crops:

- PIL (the baseline): Image.open + convert("RGB"), the v2 transforms on the PIL image, then
  PILToTensor (uint8).
- tensor (the engine's decode=cpu): torchcodec's decode_image (engine.vision.codec) + the v2
  transforms on the uint8 tensor (engine.vision.images).
- gpu path on CPU: decode=gpu's whole work done on the CPU (the worker's read, header and draw,
  then the batched decode_jpeg, crop and flip that the device does): a check that the path
  costs no more than decode=cpu where it runs on the CPU, not a GPU figure.
- gpu worker part: what a worker does with decode=gpu (read the bytes, PIL's header, draw
  the crop): how many images per second one worker core feeds a GPU.
- eval: decode + resize 256 + centre crop 224, tensor path against PIL.
- the worker stage timers: the tensor path as the engine runs it (each sample's read,
  decode and augment timed, engine.data.stages.sample_stage) against the same work untimed.

Paths alternate within each round and the median over rounds is reported (the machine is
shared and noisy). `python -m bench.decode [--quick]`.

Result (2026-12-03, 2-core CPU machine, torch 2.14.1, torchvision 0.29.1, 3 full runs): the
tensor path does 1.59-1.78x PIL's images per second for training (297-481 img/s against
168-303) and 1.99-2.18x for evaluation; decode=gpu's worker part 10.6-12.9x; decode=gpu's
whole work on the CPU 1.77-2.16x. The absolute figures moved 2x between runs on this shared
machine, the ratios much less. The engine keeps the tensor path."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from torchvision.transforms import v2

from bench.jpegs import write_jpeg_folder
from engine.vision.codec import decode_rgb
from engine.vision.gpu_decode import DeviceDecodedFiles, EncodedImage
from engine.vision.imagefolder import ImageFiles, scan_split
from engine.vision.images import ImageAugment, TrainTransform, eval_transform

UNIT = "img/s per core"
BATCH = 32  # the batched decode of the gpu path on CPU


def pil_train(aug: ImageAugment):
    crop = v2.RandomResizedCrop(aug.train_size, scale=(aug.scale_min, 1.0), antialias=True)
    steps = v2.Compose([crop, v2.RandomHorizontalFlip(), v2.PILToTensor()])
    return lambda path: steps(_open_rgb(path))


def pil_eval(aug: ImageAugment):
    steps = v2.Compose([v2.Resize(aug.eval_resize), v2.CenterCrop(aug.eval_size), v2.PILToTensor()])
    return lambda path: steps(_open_rgb(path))


def _open_rgb(path: str) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def _rate(load, keys: list) -> float:
    """Images per second of load over keys, torch's RNG seeded per sample as the loader does."""
    started = time.perf_counter()
    for k, key in enumerate(keys):
        torch.default_generator.manual_seed(k)
        load(key)
    return len(keys) / (time.perf_counter() - started)


class UntimedImageFiles(ImageFiles):
    """ImageFiles' sample without the stage timers: the baseline of their cost."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = decode_rgb(self.read(i), self.path(i))
        return self.transform(image), int(self.labels[i])


def _gpu_path_on_cpu(dataset: DeviceDecodedFiles, n: int) -> float:
    """decode=gpu's worker part and its device part, both on the CPU, in batches."""
    cpu = torch.device("cpu")
    started = time.perf_counter()
    for first in range(0, n, BATCH):
        images = []
        for i in range(first, min(n, first + BATCH)):
            torch.default_generator.manual_seed(i)
            images.append(dataset[i][0])
        dataset.images_on_device(EncodedImage.collate(images), cpu)
    return n / (time.perf_counter() - started)


def _paths(root: Path, aug: ImageAugment) -> dict:
    """name -> a function of one round giving img/s."""
    index = scan_split(root / "train")
    files = [str(Path(index.root) / f) for f in index.files]
    tensor_train, tensor_eval = (
        ImageFiles(index, TrainTransform(aug)),
        ImageFiles(index, eval_transform(aug)),
    )
    untimed = UntimedImageFiles(index, TrainTransform(aug))
    gpu = DeviceDecodedFiles(index, aug, train=True)
    n, everything = len(files), list(range(len(files)))
    train, evaluate = pil_train(aug), pil_eval(aug)
    return {
        "pil_train": lambda: _rate(train, files),
        "tensor_train": lambda: _rate(tensor_train.__getitem__, everything),
        "tensor_train_untimed": lambda: _rate(untimed.__getitem__, everything),
        "gpu_on_cpu": lambda: _gpu_path_on_cpu(gpu, n),
        "gpu_worker": lambda: _rate(gpu.__getitem__, everything),
        "pil_eval": lambda: _rate(evaluate, files),
        "tensor_eval": lambda: _rate(tensor_eval.__getitem__, everything),
    }


ENTRIES = [  # (key, baseline key, name, note)
    (
        "tensor_train",
        "pil_train",
        "train decode+augment, torchcodec tensor path (decode=cpu)",
        "decode_image + v2 RandomResizedCrop(224)+flip on uint8; baseline PIL open+convert, "
        "the same v2 on PIL, PILToTensor",
    ),
    (
        "gpu_on_cpu",
        "pil_train",
        "train, decode=gpu path run entirely on CPU",
        f"worker part + batched decode_jpeg (batches of {BATCH}) + resized_crop + flip, all on CPU",
    ),
    (
        "gpu_worker",
        "pil_train",
        "train, decode=gpu worker part only (read, header, draw)",
        "what one worker core feeds the device with decode=gpu; decoding is on the device",
    ),
    (
        "tensor_train",
        "tensor_train_untimed",
        "worker stage timers: train decode+augment timed per sample against untimed",
        "read, decode and augment each timed (engine.data.stages.sample_stage), as a loader "
        "worker sends them with its batch; baseline the same work without the timers",
    ),
    (
        "tensor_eval",
        "pil_eval",
        "eval decode+resize 256+centre crop 224, tensor path",
        "baseline: PIL open+convert, v2 Resize+CenterCrop on PIL, PILToTensor",
    ),
]


def run(quick: bool = False, smoke: bool = False) -> list[dict]:
    """smoke: 8 files, 1 round, for the test that runs every benchmark (not a measurement)."""
    aug = ImageAugment()
    rounds, per_class = (1, 2) if smoke else (7, 8) if quick else (21, 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = write_jpeg_folder(
                Path(tmp), classes=4, train_per_class=per_class, val_per_class=1
            )
            paths = _paths(root, aug)
            for measure in paths.values():  # warm-up: page cache, first-call costs
                measure()
            rates = {name: [] for name in paths}
            for r in range(rounds):
                order = list(paths) if r % 2 == 0 else list(reversed(paths))
                for name in order:
                    rates[name].append(paths[name]())
    finally:
        torch.set_num_threads(threads)
    median = {name: statistics.median(values) for name, values in rates.items()}
    return [_entry(median, key, base, name, note, rounds) for key, base, name, note in ENTRIES]


def _entry(median: dict, key: str, base: str, name: str, note: str, rounds: int) -> dict:
    return {
        "name": name,
        "measured": round(median[key], 1),
        "baseline": round(median[base], 1),
        "ratio": round(median[key] / median[base], 3),
        "target": None,
        "unit": UNIT,
        "note": f"{note}; median of {rounds} alternating rounds, 1 thread",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer files and rounds (~30 s)")
    args = parser.parse_args()
    for result in run(args.quick):
        print(
            f"{result['name']}: {result['measured']} {result['unit']} against "
            f"{result['baseline']} (ratio {result['ratio']}); {result['note']}"
        )


if __name__ == "__main__":
    main()
