"""Shared by the engine's in-process tests."""

import pytest
import torch


@pytest.fixture
def restore_backend_flags():
    """train() and setup() set global flags (TF32, cuDNN, deterministic algorithms): restored
    afterwards, for the tests that run next in this process."""
    saved = (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
    )
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:3]
    torch.backends.cudnn.deterministic = saved[3]
    torch.use_deterministic_algorithms(saved[4])
