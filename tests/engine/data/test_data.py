import random

import numpy as np
import torch

from engine.data.loaders import SeededSamples


class Draws(torch.utils.data.Dataset):
    """A dataset whose samples are random draws, as augmentations make them."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return (torch.rand(()).item(), random.random(), np.random.rand()), i


def test_a_sample_is_a_function_of_its_seed_whatever_came_before():
    data = SeededSamples(Draws(), python_numpy=True)
    first = data[(3, 12345, 0)]
    torch.rand(100), random.random(), np.random.rand(7)  # other draws in between
    assert data[(3, 12345, 0)] == first
    assert data[(3, 54321, 0)][0] != first[0]


def test_torch_only_seeding_leaves_python_and_numpy_alone():
    data = SeededSamples(Draws(), python_numpy=False)
    (t1, p1, n1), *_ = data[(1, 7, 0)]
    (t2, p2, n2), *_ = data[(1, 7, 0)]
    assert t1 == t2 and p1 != p2 and n1 != n2


def test_loading_in_the_main_process_does_not_move_the_callers_torch_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    SeededSamples(Draws())[(2, 99, 0)]
    assert torch.equal(torch.rand(3), expected)  # dropout etc. see the same stream
