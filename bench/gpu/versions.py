"""What ran: interpreter, library, CUDA and driver versions, the GPU, and the git commit."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess

import numpy
import PIL
import torch
import torchvision

from bench.gpu.harness import REPO, cpu_count
from engine import codeid


def versions(device: torch.device) -> dict:
    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": numpy.__version__,
        "pillow": PIL.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),  # bench/gpu.sh's GPU tests then run
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "platform": platform.platform(),
        "cpu_count": cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    with contextlib.suppress(Exception):
        import triton  # optional

        v["triton"] = triton.__version__
    with contextlib.suppress(Exception):
        import pytest  # optional: bench/gpu.sh runs the tests marked gpu where it is here

        v["pytest"] = pytest.__version__
    if device.type == "cuda":
        v |= gpu_versions(device)
    v["git_sha"], v["git_dirty"] = git_state()
    if v["git_sha"] is None:
        v["git_sha_note"] = "no git checkout here and RECIPES_GIT_SHA unset"
    return v


def gpu_versions(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": torch.cuda.get_device_name(device),
        "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gb": round(props.total_memory / 2**30, 1),
        "gpu_capability": f"{props.major}.{props.minor}",
        "gpu_multiprocessors": props.multi_processor_count,
        "driver": nvidia_driver(),
    }


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (
        out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    )


def git(*args: str) -> str | None:
    """git's output in the repository, None where git or the checkout is missing."""
    return codeid.git_text(REPO, *args)


def git_state() -> tuple[str | None, bool | None]:
    sha = git("rev-parse", "HEAD")
    if sha is None:
        return os.environ.get("RECIPES_GIT_SHA") or None, None
    status = git("status", "--porcelain")
    return sha, None if status is None else bool(status)
