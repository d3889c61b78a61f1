"""Two CIFAR-10 networks. Pure model code: no distributed, no I/O.

resnet18: torchvision's ResNet-18 with the CIFAR stem (3x3 stride-1 first convolution, no
max pool), as in the usual CIFAR ResNet papers and kuangliu/pytorch-cifar.

airbench: the small net of airbench94 (Keller Jordan), sized for speed: a 2x2 patch-whitening
convolution whose weights are set from the data and frozen, three conv groups (conv, max
pool, BN, GELU, conv, BN, GELU), a final max pool and a linear head scaled by 1/9. The batch
norms keep their scale at 1 (only the bias trains) and the biases learn `bias_lr_scale` times
faster, which the engine's optimizer honours through each parameter's `lr_scale`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torchvision
from torch import nn

from engine.config import bounded


@dataclass
class ModelConfig:
    arch: Literal["resnet18", "airbench"] = "resnet18"
    num_classes: int = bounded(10, ge=0)  # 0: follows the training data
    widths: list[int] = bounded(default_factory=lambda: [64, 256, 256], ge=1)  # airbench's groups
    bn_momentum: float = bounded(0.4, ge=0, le=1)  # airbench's 0.6 in torch's convention (1 - 0.6)
    bias_lr_scale: float = bounded(64.0, gt=0)  # airbench's learning-rate multiplier for BN biases
    head_scale: float = bounded(1 / 9, gt=0)


def resnet18_cifar(num_classes: int) -> nn.Module:
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()  # 32 px images: keep the resolution for the first stage
    return model


class Whiten(nn.Conv2d):
    """2x2 patch whitening: weights from the data (whiten_init), not from the optimizer."""

    def __init__(self):
        super().__init__(3, 24, kernel_size=2, padding=0, bias=True)
        self.weight.requires_grad_(False)


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _norm(channels: int, cfg: ModelConfig) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels, eps=1e-12, momentum=cfg.bn_momentum)
    bn.weight.requires_grad_(False)  # the scale stays 1; the bias trains
    bn.bias.lr_scale = cfg.bias_lr_scale
    return bn


def _conv(c_in: int, c_out: int) -> nn.Conv2d:
    conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding="same", bias=False)
    nn.init.dirac_(conv.weight.data[:c_in])  # starts as a partial identity, as airbench does
    return conv


def _group(c_in: int, c_out: int, cfg: ModelConfig) -> list[nn.Module]:
    return [
        _conv(c_in, c_out),
        nn.MaxPool2d(2),
        _norm(c_out, cfg),
        nn.GELU(),
        _conv(c_out, c_out),
        _norm(c_out, cfg),
        nn.GELU(),
    ]


def airbench_net(cfg: ModelConfig) -> nn.Sequential:
    w1, w2, w3 = cfg.widths
    return nn.Sequential(
        Whiten(),
        nn.GELU(),
        *_group(24, w1, cfg),
        *_group(w1, w2, cfg),
        *_group(w2, w3, cfg),
        nn.MaxPool2d(3),
        nn.Flatten(),
        nn.Linear(w3, cfg.num_classes, bias=False),
        Scale(cfg.head_scale),
    )


@torch.no_grad()
def whiten_init(model: nn.Module, images: torch.Tensor, eps: float = 5e-4) -> None:
    """Set the 2x2 whitening filters from the eigenvectors of the patch covariance of
    `images` (normalised float, N x 3 x H x W): 12 filters and their negatives."""
    conv = model[0]
    c, (h, w) = images.shape[1], conv.weight.shape[2:]
    patches = images.unfold(2, h, 1).unfold(3, w, 1).transpose(1, 3).reshape(-1, c * h * w)
    patches = patches.double()
    cov = (patches.T @ patches) / len(patches)
    eigenvalues, eigenvectors = torch.linalg.eigh(cov)
    filters = (eigenvectors.T / torch.sqrt(eigenvalues + eps)[:, None]).flip(0)
    filters = filters.reshape(-1, c, h, w).float()
    conv.weight.copy_(torch.cat([filters, -filters]))


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "resnet18":
        return resnet18_cifar(cfg.num_classes)
    return airbench_net(cfg)
