"""env.json's "hardware": what changes a run's bits, read on any machine without raising."""

import json

import torch

from engine import hardware, hardware_keys, tracking
from launch import hardware as compare_hardware


def test_the_facts_that_change_bits_are_all_recorded_here():
    facts = hardware.facts(torch.device("cpu"))
    assert set(compare_hardware.BITS) <= set(facts)  # launch compares what the engine writes
    assert compare_hardware.BITS is hardware_keys.BITS  # by the names written beside it
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["torch"] == torch.__version__ and facts["device"] == "cpu"
    assert facts["cpu_count"] >= 1 and facts["cpu_model"]
    assert facts["cpu_threads"] == torch.get_num_threads()  # a local twin's 2 vs a job's 1
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


# What the module docstring of launch.hardware promises to compare: a change in any one of
# them means other bits (the CPU model and instruction set, BLAS, GPU, driver, CUDA, cuDNN,
# NCCL, torch), each named here apart from BITS, so that dropping one from BITS fails. The
# values are ones no machine running this suite has (an s390x vector unit on x86, a torch from
# before 1.0): a value equal to this machine's would change nothing and prove nothing.
CHANGE_BITS = {
    "cpu_model": "IBM z16", "cpu_capability": "ZVECTOR", "cpu_threads": 4099, "blas": "essl",
    "gpu_models": ["H100"], "driver": "550.1", "cuda": "12.4", "cudnn": 90100, "nccl": "2.21.5", "torch": "0.4.1",
}  # fmt: skip


def test_runs_differing_in_any_one_fact_that_changes_bits_are_told_apart():
    here = hardware.facts(torch.device("cpu"))
    for key, other in CHANGE_BITS.items():
        assert key in here and here[key] != other, key  # the engine writes it, differently
        assert compare_hardware.differences(here, here | {key: other}) == [key], key
        note = compare_hardware.note([here, here | {key: other}])
        assert note and key in note, key
    assert compare_hardware.differences(here, here | {"cpu_count": 999}) == []  # no bit changes


def test_a_fact_a_run_recorded_before_it_existed_is_not_compared():
    """Runs written before cpu_threads was a fact are not all "different hardware"."""
    here = hardware.facts(torch.device("cpu"))
    older = {k: v for k, v in here.items() if k != "cpu_threads"}
    assert compare_hardware.differences(here, older) == []
    assert compare_hardware.note([here, older]) is None
