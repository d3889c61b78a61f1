"""Reading and decoding image files, through torchcodec: on the CPU (libjpeg-turbo, libpng,
libwebp) in loader workers, and JPEGs in batches on CUDA (nvJPEG). torchvision's decoders are
deprecated since torchvision 0.29 in favour of these; on the same bytes torchcodec's CPU
decoder gives torchvision's pixels bitwise (tests/engine/vision/test_codec.py), so runs and
checkpoints made before the switch resume unchanged.

torchcodec is a dependency (pinned in requirements.lock). A site image with torch but without
it still runs every recipe that does not read image files; one that does stops in one line
naming the package, before any worker starts (require_decoder)."""

from __future__ import annotations

import functools
import os
import re

import torch

from engine.data.errors import BadSample, DataError

TORCHCODEC_PIN = "torchcodec==0.17.0"  # requirements.lock's: the error names what to install


@functools.cache
def _decoders():
    try:
        from torchcodec import decoders  # optional: a site image may lack it (one line below)
    except ImportError as err:  # absent, or built for another torch
        raise DataError(
            f"decoding image files needs torchcodec, which cannot be imported ({err}): pip "
            f"install {TORCHCODEC_PIN} (the version requirements.lock pins for this torch)"
        ) from None
    return decoders


def require_decoder() -> None:
    """A one-line DataError now, in the main process, where torchcodec is missing."""
    _decoders()


def error_reason(err: Exception) -> str:
    # decoders' messages start with "function, source.cpp:line, "; the rest is the reason
    return re.sub(r"^\w+, \S+:\d+, ", "", str(err)).splitlines()[0]


def read_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a 1-D uint8 tensor (read straight into the tensor's memory), or
    BadSample where the file cannot be read."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            data = torch.empty(size, dtype=torch.uint8)
            read = f.readinto(memoryview(data.numpy()))
    except OSError as err:
        raise BadSample(path, err.strerror or str(err)) from None
    if read != size:  # the file changed while it was read
        raise BadSample(path, f"read {read} of its {size} bytes")
    return data


def decode_rgb(data: torch.Tensor, path: str) -> torch.Tensor:
    """A file's bytes decoded on the CPU to a uint8 (3, H, W) RGB tensor (grey, CMYK, 16-bit
    and palette images converted; an animated file's first frame), or BadSample."""
    # truncated JPEGs raise here ("Image is incomplete or truncated"), not a grey image
    try:
        image = _decoders().decode_image(data, mode="RGB", output_dtype="auto")
    except (RuntimeError, ValueError) as err:  # ValueError: no image format recognised
        raise BadSample(path, error_reason(err)) from None
    if image.dtype == torch.uint16:  # the top 8 bits, as torchvision's to_dtype (not rounded)
        image = (image.to(torch.int32) >> 8).to(torch.uint8)
    return image[0] if image.ndim == 4 else image


def decode_jpegs(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """JPEG files' bytes (1-D uint8 on the CPU) decoded in one call on `device`: uint8
    (3, H, W) RGB each. RuntimeError where the batch does not decode."""
    return _decoders().decode_jpeg(files, mode="RGB", device=device)
