import pytest

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
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_port_is_a_function_of_the_job_id():
    assert slurm_port("123") == slurm_port("123") != slurm_port("124")
    assert 20000 <= slurm_port("987654321") < 30000


def test_rank_seeds_differ():
    assert len({derive_seed(0, r) for r in range(64)}) == 64
    assert derive_seed(1, 0) != derive_seed(0, 1)
