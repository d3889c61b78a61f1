"""What changes a run's bits besides its config and code: the CPU and the instruction set
torch dispatches to, torch's BLAS and oneDNN, the GPUs, their driver, CUDA, cuDNN and NCCL,
and the deterministic flags in force. env.json records it as "hardware"; launch.hardware
compares two such records (torch-free) by the names in engine.hardware_keys, which facts()
writes (a test holds every name among them).

Every fact is read without raising: one that cannot be read here is None."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BUILD_FIELDS = {"blas": "BLAS_INFO", "lapack": "LAPACK_INFO", "mkldnn_built": "USE_MKLDNN"}


def facts(device: torch.device | str | None = None) -> dict[str, Any]:
    """This process's hardware facts, flat, for env.json's "hardware" entry."""
    cuda = _quiet(torch.cuda.is_available) or False
    return {
        "cpu_model": cpu_model(),
        "cpu_capability": _quiet(torch.backends.cpu.get_cpu_capability),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),  # as the run set them (engine.distributed)
        **build_facts(),
        "mkldnn_available": _quiet(torch.backends.mkldnn.is_available),
        "torch": torch.__version__,
        "device": None if device is None else str(device),
        "gpu_models": gpu_models() if cuda else [],
        "driver": driver_version() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": _quiet(torch.backends.cudnn.version) if cuda else None,
        "nccl": nccl_version() if cuda else None,
        "deterministic": deterministic_flags(),
    }


def _quiet(read: Callable[[], Any]) -> Any:
    """read(), or None when it raises: a fact that cannot be read is missing, never an error."""
    try:
        return read()
    except Exception:
        return None


def cpu_model() -> str | None:
    """/proc/cpuinfo's 'model name' (Linux), else platform.processor()."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else (platform.processor() or None)


def build_facts() -> dict[str, Any]:
    """BLAS_INFO, LAPACK_INFO and USE_MKLDNN from torch.__config__.show()'s build settings."""
    shown = _quiet(torch.__config__.show) or ""
    said = dict(re.findall(r"\b([A-Z_]+)=([^,\s]*)", shown))
    found: dict[str, Any] = {name: said.get(key) or None for name, key in BUILD_FIELDS.items()}
    if found["mkldnn_built"] is not None:
        found["mkldnn_built"] = found["mkldnn_built"].upper() in ("ON", "1", "TRUE")
    return found


def gpu_models() -> list[str]:
    count = _quiet(torch.cuda.device_count) or 0
    names = [_quiet(lambda i=i: torch.cuda.get_device_properties(i).name) for i in range(count)]
    return [name or "unknown" for name in names]


def driver_version() -> str | None:
    """torch's CUDA driver version where it exposes one, else nvidia-smi's (if installed)."""
    read = getattr(torch._C, "_cuda_getDriverVersion", None)
    number = _quiet(read) if read is not None else None
    if isinstance(number, int) and number > 0:
        return f"{number // 1000}.{number % 1000 // 10}"
    return nvidia_smi_driver()


def nvidia_smi_driver() -> str | None:
    program = shutil.which("nvidia-smi")
    if program is None:
        return None
    try:
        out = subprocess.run(
            [program, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def nccl_version() -> str | None:
    version = _quiet(torch.cuda.nccl.version)
    if isinstance(version, tuple):
        return ".".join(map(str, version))
    return None if version is None else str(version)


def deterministic_flags() -> dict[str, Any]:
    return {
        "algorithms": _quiet(torch.are_deterministic_algorithms_enabled),
        "cudnn_deterministic": _quiet(lambda: torch.backends.cudnn.deterministic),
        "cudnn_benchmark": _quiet(lambda: torch.backends.cudnn.benchmark),
        "matmul_tf32": _quiet(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": _quiet(lambda: torch.backends.cudnn.allow_tf32),
    }
