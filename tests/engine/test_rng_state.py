"""A checkpoint's RNG states round-trip: after set_rng_state, python's, numpy's and torch's
generators draw what they drew right after rng_state(), through a weights_only load as a
resume reads them. (The resume tests train without draws from numpy or python, so a restore
that skipped one of them would pass there.)"""

import io
import random

import numpy as np
import pytest
import torch

from engine.seeding import rng_state, seed_process, set_rng_state


def draws() -> tuple:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        float(np.random.normal()),
        torch.rand(3).tolist(),
    )


@pytest.fixture(autouse=True)
def leave_the_generators_as_found():
    """Other tests in this worker's process see the generators as they were."""
    found = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    random.setstate(found[0])
    np.random.set_state(found[1])
    torch.set_rng_state(found[2])


def test_each_generator_draws_again_what_it_drew_after_the_state_was_taken():
    seed_process(1234, rank=0)
    draws()  # move every generator away from its seeded start (and leave a gauss cached)
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    expected = draws()
    seed_process(99, rank=1)  # other states everywhere
    assert draws() != expected
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True))
    got = draws()
    for name, a, b in zip(
        ("python", "python gauss", "numpy", "numpy normal", "torch"), got, expected, strict=True
    ):
        assert a == b, f"{name} draws differ after the restore"
