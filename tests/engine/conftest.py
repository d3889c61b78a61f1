"""Shared by the engine's in-process tests."""

import pytest

from tests.helpers import backend_flags, set_backend_flags


@pytest.fixture
def restore_backend_flags():
    """train() and setup() set global flags (TF32, cuDNN, deterministic algorithms): restored
    afterwards, for the tests that run next in this process."""
    saved = backend_flags()
    yield
    set_backend_flags(saved)
