import ast
import shutil
import string
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from submitit.slurm.slurm import _parse_node_list

from engine.config import ConfigError
from engine.distributed import expand_nodelist, read_env, slurm_port
from engine.seeding import derive_seed

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "h0",
    "MASTER_PORT": "29400",
}
SRUN = {
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "6",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_JOB_ID": "123456",
}


def test_single_process():
    env = read_env({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")


def test_torchrun():
    env = read_env(TORCHRUN)
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port) == (
        3,
        1,
        4,
        "h0",
        29400,
    )


@pytest.mark.parametrize("drop", sorted(TORCHRUN))
def test_half_set_torchrun_env_names_what_is_missing(drop):
    env = {k: v for k, v in TORCHRUN.items() if k != drop}
    with pytest.raises(ConfigError, match=f"{drop} missing"):
        read_env(env)


def test_srun_task():
    env = read_env(SRUN)
    assert (env.rank, env.local_rank, env.world_size, env.source) == (5, 1, 6, "slurm")
    assert env.master_addr == "gpu07" and env.master_port == slurm_port("123456")


def test_batch_script_is_not_a_task():
    # sbatch's own shell has SLURM_PROCID=0 but no step: it is one plain process
    env = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert read_env(env).world_size == 1


def test_incomplete_srun_env():
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST missing"):
        read_env({k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"})


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-2]", ["node1", "node2"]),
        ("gpu[01-03,7],cpu5", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]),
        ("a[098-100]", ["a098", "a099", "a100"]),
        ("a[1-03]", ["a1", "a2", "a3"]),  # the first number sets the width
        ("node[01-02]-ib", ["node01-ib", "node02-ib"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a[1-2],b5,c[07-08]-x", ["a1", "a2", "b5", "c07-x", "c08-x"]),
        ("a[3,1],a[1]", ["a3", "a1", "a1"]),  # SLURM's order, duplicates kept
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["a[1-2", "a]1", "a[[1]]", "a[3-1]", "a[x]", "a[]", ",", ""])
def test_a_malformed_nodelist_is_a_config_error(nodelist):
    with pytest.raises(ConfigError, match="node list"):
        expand_nodelist(nodelist)


# Random node lists of the forms clusters use: names with prefixes and suffixes, several
# ranges and single numbers per bracket, zero padding, several brackets per name, and
# comma-separated names.
HOST_CHARS = string.ascii_letters + string.digits + "-_."
SCONTROL = shutil.which("scontrol")


@st.composite
def bracket(draw) -> str:
    """[01-03,7]: 1-3 numbers or ranges, zero-padded or not (the first number sets the width)."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        lo = draw(st.integers(0, 120))
        text = f"{lo:0{len(str(lo)) + draw(st.integers(0, 2))}d}"
        if draw(st.booleans()):
            text += f"-{lo + draw(st.integers(0, 4)):0{draw(st.integers(1, 4))}d}"
        parts.append(text)
    return f"[{','.join(parts)}]"


@st.composite
def host_pattern(draw, suffix: bool) -> str:
    """name[..]text[..]text: up to two brackets; the text after the last one only if suffix."""
    pieces = [draw(st.sampled_from(string.ascii_letters)) + draw(st.text(HOST_CHARS, max_size=4))]
    for _ in range(draw(st.integers(0, 2))):
        pieces += [draw(bracket()), draw(st.text(HOST_CHARS, max_size=4))]
    if not suffix and len(pieces) > 1:
        pieces[-1] = ""
    return "".join(pieces)


def nodelists(suffix: bool = True):
    return st.lists(host_pattern(suffix), min_size=1, max_size=3).map(",".join)


@settings(max_examples=300, deadline=None, database=None)
@given(nodelists())
def test_expand_nodelist_agrees_with_submitit(nodelist):
    assert expand_nodelist(nodelist) == _parse_node_list(nodelist)


@pytest.mark.skipif(
    SCONTROL is None, reason="scontrol is not on PATH (apt-get install slurm-client)"
)
@settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(nodelists(suffix=False))  # Slurm 22.05 rejects text after a name's last bracket
def test_expand_nodelist_agrees_with_scontrol(nodelist):
    done = subprocess.run(
        [SCONTROL, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
    )
    assert not done.stderr, (nodelist, done.stderr)  # "Invalid hostlist" exits 0
    assert expand_nodelist(nodelist) == done.stdout.split()


def test_the_engine_never_imports_submitit():
    """Training runs on machines without submitit; only launch/ may import it."""
    engine = Path(__file__).resolve().parents[2] / "engine"
    importers = []
    for path in sorted(engine.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n.split(".")[0] == "submitit" for n in names):
                importers.append(f"{path.name}:{node.lineno}")
    assert not importers


def test_port_is_a_function_of_the_job_id():
    assert slurm_port("123") == slurm_port("123") != slurm_port("124")
    assert 20000 <= slurm_port("987654321") < 30000


def test_rank_seeds_differ():
    assert len({derive_seed(0, r) for r in range(64)}) == 64
    assert derive_seed(1, 0) != derive_seed(0, 1)
