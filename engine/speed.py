"""The speed defaults and the figures that say how fast a run goes: memory format, compile,
TF32 and cuDNN flags, FLOPs per sample and the device's peak, for MFU."""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from engine.config import TrainConfig

# Dense bf16 peak of one device, TFLOP/s, from the vendors' datasheets (half their "with
# sparsity" figures), by the whole name torch.cuda.get_device_name reports: the parts of one
# chip differ in clocks and power (an H100 PCIe has 0.76 of the SXM part's peak), so a name
# seen only in part is not guessed at. Others: set log.peak_tflops.
PEAK_BF16_TFLOPS = (
    (r"NVIDIA B200", 2250.0),
    (r"NVIDIA H200 NVL", 835.0),
    (r"NVIDIA H200", 989.0),  # SXM
    (r"NVIDIA GH200 \d+GB", 989.0),
    (r"NVIDIA H100 NVL", 835.0),
    (r"NVIDIA H100 PCIe", 756.0),
    (r"NVIDIA H100 80GB HBM3", 989.0),  # SXM5
    (r"NVIDIA A100-SXM4-(40|80)GB", 312.0),
    (r"NVIDIA A100(-PCIE-40GB| 80GB PCIe)", 312.0),
)


def datasheet_peak_tflops(device_name: str) -> float:
    """The table's figure for a device of exactly this name; 0 for any other."""
    name = device_name.strip()
    return next((tf for pattern, tf in PEAK_BF16_TFLOPS if re.fullmatch(pattern, name)), 0.0)


def set_backend_flags(cfg: TrainConfig, deterministic: bool) -> None:
    """TF32 matmuls and convolutions, and cuDNN's autotuner (it times kernels for each new
    input shape and keeps the fastest), unless deterministic: both change results between
    runs or machines, and deterministic promises bitwise repeatable ones."""
    tf32 = cfg.tf32 and not deterministic
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not deterministic


def memory_format(model: nn.Module, channels_last: bool) -> torch.memory_format:
    """channels_last for models with 2-d convolutions (NHWC kernels are faster on GPUs with
    tensor cores and on most CPUs); anything else keeps the default layout."""
    convolutional = any(isinstance(m, nn.Conv2d) for m in model.modules())
    return torch.channels_last if channels_last and convolutional else torch.contiguous_format


def compile_enabled(choice: str, device: torch.device) -> bool:
    """auto: compile on CUDA, where it pays; on CPU its start-up cost rarely does."""
    return choice == "on" or (choice == "auto" and device.type == "cuda")


def flops_per_sample(recipe, cfg) -> float:
    """Training FLOPs per sample: 3x the forward pass (the backward pass costs about twice
    the forward), counted by torch's FlopCounterMode on a copy of the model on the meta
    device, so it costs neither memory nor compute. 0 when the recipe declares no input."""
    if recipe.sample_shape is None:
        return 0.0
    from torch.utils.flop_counter import FlopCounterMode  # start-up time: imports triton

    shape = recipe.sample_shape(cfg.data)
    with torch.device("meta"):
        # eval mode: batch norm on a 1x1 feature map refuses a batch of one in training mode
        model = recipe.build_model(copy.deepcopy(cfg.model)).eval()
        sample = torch.zeros((1, *shape))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(sample)
    return 3.0 * counter.get_total_flops()


def peak_flops(peak_tflops: float, device: torch.device) -> float:
    """One device's peak FLOP/s: log.peak_tflops when set, else the datasheet figure of a
    GPU the table names exactly; 0 (no MFU) otherwise, CPUs included."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return 0.0
    return datasheet_peak_tflops(torch.cuda.get_device_name(device)) * 1e12


def gpu_memory_gb(device: torch.device) -> float | None:
    """The most memory this process's tensors held on the GPU so far (high-water mark)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30
