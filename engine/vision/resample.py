"""A whole batch of differently sized images cropped, resized (antialiased bilinear or bicubic,
torch's `_upsample_*2d_aa` filters and weights), flipped and cut to one output size, in a
number of operations that does not grow with the batch: what data.decode=gpu does on CUDA to
every batch, where a loop over the images cost ~1,000 torch calls and ~512 kernel launches per
batch of 256, all on the thread that competes with the step's launches for the GIL.

Each sample n is described by integers known on the host before anything runs on the device
(the workers read the sizes from the files' headers and drew the boxes): its place in one flat
buffer holding every decoded image (offset, strides of channel, row and column), the box of the source it
samples (top, left, h, w), the size (RH, RW) that box is resized to, the window of that
resized image kept (rows from a, columns from b, `size` of each) and whether it is mirrored.
Training: the drawn box, resized to size × size, window at 0. Evaluation: the whole image,
its shorter side resized to eval_resize, the centre window (torchvision's own rounding).

The resize is separable, as torch's own kernel: first along the height (each kept output row
is a weighted sum of `taps` source rows, gathered from the flat buffer), then along the width
(gathered from that intermediate). The weights are torch's (the filter, support = the scale
when shrinking, normalised to sum 1), computed for the whole batch at once on the device; the
sums run in another order than torch's per-image kernel (height first; float32 throughout), so
a value can land on the other side of a rounding edge: after rounding to whole levels the
result differs from torchvision's per-image float path by at most one level in a small share
of values (tests/engine/vision/test_resample.py states and checks the figures)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

# transient memory of one pass (the gathered indices and the intermediate), beyond which the
# batch is resampled in parts: only batches holding very large images are split
PART_BYTES = 1 << 30


@dataclass(frozen=True)
class Geometry:
    """Per sample, host integers (numpy int64, length N each); see the module's docstring."""

    offset: np.ndarray
    channel_stride: np.ndarray
    row_stride: np.ndarray
    column_stride: np.ndarray
    top: np.ndarray
    left: np.ndarray
    box_h: np.ndarray
    box_w: np.ndarray
    resized_h: np.ndarray
    resized_w: np.ndarray
    row0: np.ndarray
    col0: np.ndarray
    flip: np.ndarray

    def __len__(self) -> int:
        return len(self.offset)

    def rows(self) -> np.ndarray:
        return np.stack([getattr(self, f) for f in self.__dataclass_fields__], axis=1)


def pack(images: list[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(one flat uint8 buffer holding every (3, H, W) image in turn, per image its offset
    and its strides (channel, row, column) in that buffer (N, 3), sizes (N, 2)): one copy,
    whatever the batch size. Each image goes in in its own memory order (decoders give CHW or
    HWC), so that flattening it is a view, not a copy per image."""
    stored, strides, sizes = [], [], []
    for image in images:
        view, stride = _in_memory_order(image)
        stored.append(view)
        strides.append(stride)
        sizes.append(image.shape[-2:])
    sizes = np.array(sizes, dtype=np.int64).reshape(-1, 2)
    per_image = 3 * sizes[:, 0] * sizes[:, 1]
    offsets = np.concatenate([[0], np.cumsum(per_image)[:-1]]).astype(np.int64)
    layout = np.concatenate([offsets[:, None], np.array(strides, dtype=np.int64)], axis=1)
    return _flatten_dense_tensors(stored), layout, sizes


def _in_memory_order(image: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    height, width = image.shape[-2:]
    if image.is_contiguous():
        return image, (height * width, width, 1)
    hwc = image.permute(1, 2, 0)
    if hwc.is_contiguous():
        return hwc, (1, 3 * width, 3)
    return image.contiguous(), (height * width, width, 1)


def training_geometry(layout, sizes, boxes, flips, size: int) -> Geometry:
    """RandomResizedCrop's drawn boxes (top, left, h, w), resized to size × size."""
    boxes = np.asarray(boxes, dtype=np.int64).reshape(-1, 4)
    n, full = len(boxes), np.full(len(boxes), size, dtype=np.int64)
    return Geometry(
        **_placed(layout),
        top=boxes[:, 0],
        left=boxes[:, 1],
        box_h=boxes[:, 2],
        box_w=boxes[:, 3],
        resized_h=full,
        resized_w=full,
        row0=np.zeros(n, dtype=np.int64),
        col0=np.zeros(n, dtype=np.int64),
        flip=np.asarray(flips, dtype=np.int64).reshape(n),
    )


def evaluation_geometry(layout, sizes, resize: int, size: int) -> Geometry | None:
    """Resize(resize) on the shorter side then CenterCrop(size), with torchvision's own
    integer arithmetic (v2's _compute_resized_output_size, center_crop's rounding); None where
    some image would be padded (a resized side below size: torchvision's own steps then)."""
    h, w = sizes[:, 0], sizes[:, 1]
    short, long = np.minimum(h, w), np.maximum(h, w)
    new_long = np.floor(resize * long / short).astype(np.int64)  # int(size * long / short)
    resized_h = np.where(h <= w, resize, new_long)
    resized_w = np.where(h <= w, new_long, resize)
    if (resized_h < size).any() or (resized_w < size).any():
        return None
    zeros = np.zeros(len(h), dtype=np.int64)
    return Geometry(
        **_placed(layout),
        top=zeros,
        left=zeros,
        box_h=h,
        box_w=w,
        resized_h=resized_h,
        resized_w=resized_w,
        row0=np.round((resized_h - size) / 2.0).astype(np.int64),  # half to even, as round()
        col0=np.round((resized_w - size) / 2.0).astype(np.int64),
        flip=zeros,
    )


def _placed(layout) -> dict[str, np.ndarray]:
    layout = np.asarray(layout, dtype=np.int64).reshape(-1, 4)
    names = ("offset", "channel_stride", "row_stride", "column_stride")
    return {name: layout[:, k] for k, name in enumerate(names)}


def resample(flat: torch.Tensor, geometry: Geometry, size: int, mode: str) -> torch.Tensor:
    """float32 (N, 3, size, size) holding whole levels 0..255 (rounded half to even, clamped:
    what torchvision's float resize keeps when it converts back to uint8)."""
    taps_h = _taps(geometry.box_h, geometry.resized_h, mode)
    taps_w = _taps(geometry.box_w, geometry.resized_w, mode)
    widest = int(geometry.box_w.max())
    per_sample = 3 * size * widest * (8 + 4) + 3 * size * size * 8
    part = max(1, PART_BYTES // per_sample)
    pinned = flat.device.type == "cuda"
    table = torch.from_numpy(geometry.rows())
    table = (table.pin_memory() if pinned else table).to(flat.device, non_blocking=True)
    out = [
        _resample_part(flat, table[k : k + part], size, mode, taps_h, taps_w, widest)
        for k in range(0, len(geometry), part)
    ]
    batch = out[0] if len(out) == 1 else torch.cat(out)
    return batch.round_().clamp_(0, 255)


def _taps(box: np.ndarray, resized: np.ndarray, mode: str) -> int:
    """The most source pixels one output pixel reads in this batch (torch's xsize bound)."""
    scale = np.maximum(box / resized, 1.0)
    return int(np.ceil(SUPPORT[mode] * scale).max()) * 2 + 1


SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}


def _filter(x: torch.Tensor, mode: str) -> torch.Tensor:
    x = x.abs()
    if mode == "bilinear":
        return (1.0 - x).clamp_(min=0.0)
    a = -0.5  # Keys' cubic, as torch's antialiased bicubic
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return torch.where(x < 1.0, near, torch.where(x < 2.0, far, torch.zeros_like(x)))


def _weights(box, resized, first, count: int, taps: int, mode: str):
    """(start index in the box (N, count), weights (N, count, taps)) of output indices
    first..first+count-1 of a box of `box` pixels resized to `resized`: torch's
    _compute_indices_min_size_weights_aa for every sample at once."""
    scale = (box.float() / resized.float())[:, None]
    support = torch.where(
        scale >= 1.0, scale * SUPPORT[mode], torch.full_like(scale, SUPPORT[mode])
    )
    inverse = torch.where(scale >= 1.0, 1.0 / scale, torch.ones_like(scale))
    index = first[:, None] + torch.arange(count, device=box.device)[None, :]
    centre = scale * (index.float() + 0.5)
    start = (centre - support + 0.5).trunc().clamp_(min=0).long()
    stop = torch.minimum((centre + support + 0.5).trunc().long(), box[:, None])
    tap = torch.arange(taps, device=box.device)
    distance = (tap[None, None, :] + start[..., None] - centre[..., None] + 0.5) * inverse[
        ..., None
    ]
    weights = _filter(distance, mode) * (tap[None, None, :] < (stop - start)[..., None])
    total = weights.sum(-1, keepdim=True)
    return start, weights / torch.where(total == 0, torch.ones_like(total), total)


def _resample_part(flat, table, size: int, mode: str, taps_h: int, taps_w: int, widest: int):
    (offset, channel_s, row_s, column_s, top, left, box_h, box_w) = table.unbind(1)[:8]
    (resized_h, resized_w, row0, col0, flip) = table.unbind(1)[8:]
    n, device = len(table), flat.device
    # along the height: rows row0.. of the resized box, every column of the box
    start_h, w_h = _weights(box_h, resized_h, row0, size, taps_h, mode)
    channel = torch.arange(3, device=device)[None, :, None, None] * channel_s[:, None, None, None]
    column = torch.minimum(torch.arange(widest, device=device)[None, :], box_w[:, None] - 1)
    column = (left[:, None] + column) * column_s[:, None]
    base = offset[:, None, None, None] + channel
    tall = torch.zeros(n, 3, size, widest, dtype=torch.float32, device=device)
    last_row = (top + box_h - 1)[:, None]
    for k in range(taps_h):
        row = torch.minimum(top[:, None] + start_h + k, last_row)  # weight 0 past the box
        index = base + (row * row_s[:, None])[:, None, :, None] + column[:, None, None, :]
        tall.addcmul_(flat.take(index).float(), w_h[:, None, :, k, None])
    # along the width: columns col0.. of the resized box, mirrored where drawn so
    start_w, w_w = _weights(box_w, resized_w, col0, size, taps_w, mode)
    mirrored = flip.bool()[:, None, None]
    start_w = torch.where(mirrored[..., 0], start_w.flip(1), start_w)
    w_w = torch.where(mirrored, w_w.flip(1), w_w)
    out = torch.zeros(n, 3, size, size, dtype=torch.float32, device=device)
    last_column = (box_w - 1)[:, None]
    for k in range(taps_w):
        index = torch.minimum(start_w + k, last_column)[:, None, None, :].expand(n, 3, size, size)
        out.addcmul_(tall.gather(3, index), w_w[:, None, None, :, k])
    return out
