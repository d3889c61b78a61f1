"""Compile captures the whole model on every torch the project supports. Before torch 2.14
(pytorch/pytorch#150915), `module.compile()` of a module whose forward dynamo skips as torch's
own code (an nn.Sequential: the CIFAR fast net) captured nothing of its layers, and under DDP
the model ran eagerly. The tests imitate that torch by switching off 2.14's fix, check that
the imitation fails the way the old torch did, then that engine.parallel.compile_in_place
captures every layer there, under DDP too."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from engine.parallel import compile_in_place
from engine.spawn import free_port

LAYERS = 14


def sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) if k % 2 == 0 else nn.ReLU() for k in range(LAYERS)])


class Captured:
    """A compile backend that counts the operations in every graph dynamo hands it."""

    def __init__(self):
        self.ops: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs):
        kinds = ("call_function", "call_module", "call_method")
        self.ops.append(sum(node.op in kinds for node in gm.graph.nodes))
        return gm.forward


@pytest.fixture
def old_torch(monkeypatch):
    """Dynamo as before 2.14: a compiled Module._call_impl is never wrapped in a frame that
    lets dynamo trace into a skipped forward."""
    monkeypatch.setattr(
        OptimizedModule, "_should_wrap_module_call_impl", staticmethod(lambda fn: False)
    )
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_imitation_fails_as_the_old_torch_did(old_torch):
    model, backend = sequential(), Captured()
    model.compile(backend=backend)
    model(torch.randn(4, 8))
    assert sum(backend.ops) < LAYERS  # torch's own compile: the layers ran uncaptured


def test_compile_in_place_captures_every_layer_where_module_compile_did_not(old_torch):
    model, backend = sequential(), Captured()
    x = torch.randn(4, 8)
    expected = model(x)
    compile_in_place(model, backend=backend)
    assert torch.equal(model(x), expected)
    assert backend.ops == [LAYERS]
    assert list(model.state_dict()) == list(sequential().state_dict())  # keys unchanged


@pytest.mark.slow  # a process group and dynamo's DDP optimizer: seconds
def test_under_ddp_the_compiled_model_is_captured(old_torch):
    """The engine's DDP path: compiled in place, then wrapped (engine.parallel.wrap)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model, backend = sequential(), Captured()
        compile_in_place(model, backend=backend, dynamic=False)
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp(torch.randn(4, 8)).sum().backward()
        assert sum(backend.ops) >= LAYERS  # DDP's optimizer may split it at buckets
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()
