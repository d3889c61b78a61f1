"""env.json's "hardware": what changes a run's bits, read on any machine without raising."""

import json

import torch

from engine import hardware, tracking
from launch import hardware as compare_hardware


def test_the_facts_that_change_bits_are_all_recorded_here():
    facts = hardware.facts(torch.device("cpu"))
    assert set(compare_hardware.BITS) <= set(facts)  # launch compares what the engine writes
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["torch"] == torch.__version__ and facts["device"] == "cpu"
    assert facts["cpu_count"] >= 1 and facts["cpu_model"]
    assert facts["mkldnn_available"] == torch.backends.mkldnn.is_available()
    assert set(facts["deterministic"]) == {
        "algorithms", "cudnn_deterministic", "cudnn_benchmark", "matmul_tf32", "cudnn_tf32"
    }  # fmt: skip
    if not torch.cuda.is_available():
        assert facts["gpu_models"] == [] and facts["driver"] is facts["nccl"] is None
    json.dumps(facts)  # env.json holds it as it is


def test_a_fact_that_cannot_be_read_is_none(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("not here")

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", broken)
    monkeypatch.setattr(torch.__config__, "show", broken)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", broken)
    facts = hardware.facts()
    assert facts["cpu_capability"] is facts["blas"] is facts["mkldnn_built"] is None
    assert facts["deterministic"]["algorithms"] is None and facts["device"] is None


def test_the_deterministic_flags_in_force_are_recorded():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert hardware.facts()["deterministic"]["algorithms"] is True
    finally:
        torch.use_deterministic_algorithms(before)


def test_env_json_names_the_hardware():
    env = tracking.environment(1, ["host"], torch.device("cpu"), {"commit": None})
    assert env["hardware"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
