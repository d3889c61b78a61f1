"""decode_stages: where (b)'s GPU-decode path spends its time, stage by stage, on (b)'s folder
of generated JPEGs (its batch, image size and loader workers).

decode: the engine's batched JPEG decode alone (engine.vision.codec.decode_jpegs on the
device: nvJPEG on CUDA) of batches of the folder's files, their bytes already in memory.
augment: the training crop, resize and flip alone (engine.vision.gpu_decode.crop_flip_batch)
of those images, already decoded and resident on the device.
finish_thread: the same decoded images, as pre-decoded batches, through the thread that
finishes batches ahead (engine.data.prefetch.FinishAhead, depth 1): cropped, flipped and
normalised on its own stream, consumed by this thread: the thread's and the stream
handover's cost without decoding.
engine.*: the whole engine path (data.decode=gpu), eager, at loader.decode_ahead 1 and 3 and
loader.num_workers cores/2 ("half_cores") and cores - 1 ("most_cores"): images/s and each
window's breakdown (data_wait, to_device, step_host, sync, decode, augment, finish_thread,
gpu_data_wait: shares of the timed windows' wall time, engine.meter.Meter.breakdown).
split.*: the same run at the GPU/CPU decode split data.cpu_decode_share 0 ("gpu_only") and
0.25 ("cpu_quarter"), where this checkout's imagenet config has that key.

decode, augment and finish_thread time `stage_batches` batches after one untimed batch,
between torch.cuda.synchronize calls. The engine runs are eager: six more compilations of
ResNet-50 would not fit the budget; compare them with each other and with (b)'s eager
figures, not with (b)'s compiled ones. On a CPU (smoke) every stage runs on the CPU and
decode_ahead has no thread to act on: code paths only."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torchvision.transforms import RandomResizedCrop

from bench.gpu.engine_runs import close_run, engine_run, has_key
from bench.gpu.harness import Bench, Skip, attempt, cpu_count, get, timed
from bench.gpu.jpeg import check_epoch_length, jpeg_folder, jpeg_overrides, timed_windows
from engine.data.prefetch import FinishAhead
from engine.data.stages import STAGES
from engine.vision.codec import decode_jpegs, read_bytes
from engine.vision.gpu_decode import crop_flip_batch
from engine.vision.images import IMAGENET_MEAN, IMAGENET_STD, normalise_on_device

ENGINE_RUNS = {  # part -> (loader.decode_ahead, workers: "half" or "most" of the cores)
    "engine.ahead1_half_cores": (1, "half"),
    "engine.ahead3_half_cores": (3, "half"),
    "engine.ahead1_most_cores": (1, "most"),
    "engine.ahead3_most_cores": (3, "most"),
}
SPLITS = {"split.gpu_only": 0.0, "split.cpu_quarter": 0.25}  # part -> data.cpu_decode_share
Sample = collections.namedtuple("Sample", "x y")


@dataclass
class Decoded:
    """A pre-decoded batch: images on the device, with their drawn crops and flips."""

    images: list[torch.Tensor]
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    size: int


def workers(share: str) -> int:
    return max(1, cpu_count() // 2 if share == "half" else cpu_count() - 1)


def file_batches(bench: Bench) -> list[list[torch.Tensor]]:
    """1 + stage_batches batches of distinct training files' bytes, read once."""
    if "stage_files" not in bench.cache:
        root = jpeg_folder(bench)["root"] / "train"
        paths = sorted(root.rglob("*.JPEG"))
        n, b = 1 + bench.sizes.stage_batches, bench.sizes.batch
        if len(paths) < n * b:
            raise RuntimeError(f"{len(paths)} training files, fewer than {n} batches of {b}")
        data = [read_bytes(str(p)) for p in paths[: n * b]]
        bench.cache["stage_files"] = [data[k * b : (k + 1) * b] for k in range(n)]
    return bench.cache["stage_files"]


def decode_all(bench: Bench, batches: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [decode_jpegs(files, bench.device) for files in batches]


def decoded_batches(bench: Bench) -> list[Decoded]:
    """The file batches decoded on the device (kept for augment and finish_thread), each
    image with a crop drawn as RandomResizedCrop draws it and a coin-flip mirror."""
    if "stage_decoded" not in bench.cache:
        size, generator = bench.sizes.image, torch.Generator().manual_seed(0)
        batches = []
        for images in decode_all(bench, file_batches(bench)):
            boxes = [RandomResizedCrop.get_params(im, (0.08, 1.0), (3 / 4, 4 / 3)) for im in images]
            flips = (torch.rand(len(images), generator=generator) < 0.5).tolist()
            batches.append(Decoded(images, boxes, flips, size))
        bench.cache["stage_decoded"] = batches
    return bench.cache["stage_decoded"]


def images_per_s(bench: Bench, seconds: float, batches: int) -> dict:
    images = batches * bench.sizes.batch
    return {
        "timed_images": images,
        "seconds_timed": round(seconds, 4),
        "img_per_s": round(images / seconds, 1),
    }


def decode_part(bench: Bench) -> dict:
    first, *timed_batches = file_batches(bench)
    decode_jpegs(first, bench.device)  # the decoder's start (nvJPEG's handles) untimed
    seconds = timed(bench, lambda: decode_all(bench, timed_batches))
    mean_kb = sum(len(f) for b in timed_batches for f in b) / (
        len(timed_batches) * bench.sizes.batch
    )
    return {"mean_file_kb": round(mean_kb / 1024, 1)} | images_per_s(
        bench, seconds, len(timed_batches)
    )


def augment(batch: Decoded) -> torch.Tensor:
    return crop_flip_batch(batch.images, batch.boxes, batch.flips, batch.size)


def augment_part(bench: Bench) -> dict:
    first, *rest = decoded_batches(bench)
    augment(first)
    seconds = timed(bench, lambda: [augment(b) for b in rest])
    return {"output_size": bench.sizes.image} | images_per_s(bench, seconds, len(rest))


def finish(batch: Decoded, device: torch.device) -> torch.Tensor:
    """What the finishing thread does to a batch, less the decode: crop, flip, normalise."""
    return normalise_on_device(augment(batch), device, IMAGENET_MEAN, IMAGENET_STD)


def through_thread(bench: Bench, batches: list[Decoded]) -> None:
    samples = [Sample(b, None) for b in batches]
    ahead = FinishAhead(samples, finish, bench.device, depth=1, memory_format=torch.channels_last)
    try:
        for sample in ahead:
            sample.x.tensor.sum()  # a use on the training stream, as a step's first kernel
    finally:
        ahead.close()


def finish_thread_part(bench: Bench) -> dict:
    first, *rest = decoded_batches(bench)
    through_thread(bench, [first])  # the thread's stream and kernels' first launch untimed
    STAGES.take()
    seconds = timed(bench, lambda: through_thread(bench, rest))
    stages = STAGES.take()
    out = images_per_s(bench, seconds, len(rest))
    out["thread_busy_share"] = round(stages.get("finish_thread", 0.0) / seconds, 4)
    out["gpu_data_wait_share"] = round(stages.get("gpu_data_wait", 0.0) / seconds, 4)
    out["streams"] = bench.device.type == "cuda"
    return out


def engine_part(bench: Bench, name: str, depth: int, share_of_cores: str, split=None) -> dict:
    """The engine's decode=gpu path, eager, at this depth, worker count and decode split."""
    count = workers(share_of_cores)
    overrides = jpeg_overrides(bench, "gpu", False, count) + [f"loader.decode_ahead={depth}"]
    if split is not None:
        overrides.append(f"data.cpu_decode_share={split}")
    run = engine_run(bench, "imagenet", overrides, f"stages-{name.replace('.', '-')}")
    try:
        check_epoch_length(bench, run)
        out = {"decode_ahead": depth, "loader_workers": count, "compiled": False}
        if split is not None:
            out["cpu_decode_share"] = split
        windows = max(1, bench.sizes.stage_windows // (2 if bench.tight("decode_stages") else 1))
        return out | timed_windows(bench, run, windows)
    finally:
        close_run(run)


def split_part(bench: Bench, name: str, share: float) -> dict:
    if not has_key("imagenet", "data.cpu_decode_share"):
        raise Skip("this checkout's imagenet data config has no data.cpu_decode_share")
    return engine_part(bench, name, 1, "most", share)


def decode_stages(bench: Bench) -> dict:
    out = bench.entry("decode_stages")  # in the JSON from the start, the parts with it
    out |= {"batch": bench.sizes.batch, "image": bench.sizes.image, "device": str(bench.device)}
    isolated = {"decode": decode_part, "augment": augment_part, "finish_thread": finish_thread_part}
    try:
        for part, fn in isolated.items():
            label = f"decode stages: {part}"
            attempt(bench, f"decode_stages.{part}", label, lambda f=fn: f(bench), bench.need(5))
    finally:  # the decoded images leave the device before the engine runs
        bench.cache.pop("stage_decoded", None)
        bench.cache.pop("stage_files", None)
    for part, (depth, cores) in ENGINE_RUNS.items():
        attempt(
            bench,
            f"decode_stages.{part}",
            f"decode stages: {part}",
            lambda p=part, d=depth, c=cores: made(bench, p) and engine_part(bench, p, d, c),
            need_s=bench.need(8),
        )
    for part, share in SPLITS.items():
        attempt(
            bench,
            f"decode_stages.{part}",
            f"decode stages: {part}",
            lambda p=part, s=share: made(bench, p) and split_part(bench, p, s),
            need_s=bench.need(8),
        )
    return {}


def made(bench: Bench, part: str) -> bool:
    """True where the sizes make this run; else Skip, with the reason."""
    runs = bench.sizes.stage_runs
    if runs is not None and part not in runs:
        raise Skip(f"this run's sizes make only {', '.join(runs)} of the engine runs")
    return True


def summary(entry: dict) -> list[str]:
    """img/s of each stage alone, and of each engine run with its largest shares."""
    lines = []
    for part in ("decode", "augment", "finish_thread", *ENGINE_RUNS, *SPLITS):
        e = get(entry, *part.split("."))
        if not isinstance(e, dict):
            continue
        if e.get("status") != "ok":
            lines.append(f"  decode stage {part}: {e.get('status')} {e.get('reason', '')}".rstrip())
            continue
        text = f"  decode stage {part:26s} {e['img_per_s']:9.1f} img/s"
        shares = e.get("breakdown")
        if shares:
            top = sorted(shares.items(), key=lambda kv: -kv[1])[:3]
            text += ", " + ", ".join(f"{k} {v:.1%}" for k, v in top)
        lines.append(text)
    return lines
