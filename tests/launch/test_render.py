"""launch.render: every target's argv, flags, quoting, ranks, and the injection string."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from launch import cli, render
from launch.render import Docker, LaunchRequest, Slurm

ROOT = Path(__file__).resolve().parents[2]
PY = "/venv/bin/python"
INJECT = '"; rm -rf x"'  # must stay one inert argv element everywhere
INJECT_KV = "note=$(touch pwned); `touch pwned2` ' \" \\ ;"


def req(**kw) -> LaunchRequest:
    """A request as launch resolves it; GPUS=0 asks for device=cpu."""
    base = dict(recipe="digits", run_name="RUN", python=PY, src="/src", image="img:1")
    base["device"] = "cpu" if not kw.get("gpus") else ""
    return LaunchRequest(**{**base, **kw})


# NCCL's flight recorder, where NCCL may run (tests/launch/test_flight_recorder.py)
FLIGHT_RECORDER = [
    "env", "TORCH_FR_BUFFER_SIZE=2000", "TORCH_NCCL_DUMP_ON_TIMEOUT=1",
    "TORCH_FR_DUMP_TEMP_FILE=runs/digits/RUN/hang/nccl_trace_rank_",
]  # fmt: skip


def count(argv, item):
    return sum(1 for a in argv if a == item)


# ---------------------------------------------------------------- plain python and torchrun


def test_cpu_single_process_is_plain_python_with_device_cpu():
    assert render.local(req(gpus=0)) == [
        PY, "-m", "engine.train", "digits", "device=cpu", "run.name=RUN"
    ]  # fmt: skip


def test_one_gpu_is_plain_python_on_the_default_device():
    assert render.local(req(gpus=1)) == [PY, "-m", "engine.train", "digits", "run.name=RUN"]


def test_gpus_above_one_is_torchrun_standalone_one_process_per_gpu():
    argv = render.local(req(gpus=8, overrides=("optim.lr=0.2",)))
    assert argv == [
        *FLIGHT_RECORDER, PY, "-m", "engine.torchrun", "--standalone", "--nproc_per_node=8",
        "-m", "engine.train", "digits", "run.name=RUN", "optim.lr=0.2",
    ]  # fmt: skip
    assert "device=cpu" not in argv


def test_cpu_processes_are_torchrun_standalone_with_device_cpu():
    argv = render.local(req(gpus=0, procs=3))
    assert argv[:5] == [PY, "-m", "engine.torchrun", "--standalone", "--nproc_per_node=3"]
    assert argv[5:] == ["-m", "engine.train", "digits", "device=cpu", "run.name=RUN"]


def test_multi_node_is_c10d_rendezvous_without_node_rank():
    argv = render.local(req(gpus=4, nodes=3, rdzv_endpoint="node1:29500"))
    assert argv == [
        *FLIGHT_RECORDER, PY, "-m", "engine.torchrun", "--nnodes=3", "--nproc_per_node=4",
        "--rdzv_backend=c10d", "--rdzv_endpoint=node1:29500", "--rdzv_id=RUN",
        "-m", "engine.train", "digits", "run.name=RUN",
    ]  # fmt: skip
    assert not any("node_rank" in a or "node-rank" in a or a == "--standalone" for a in argv)


def test_multi_node_cpu_uses_procs_per_node():
    argv = render.local(req(gpus=0, procs=2, nodes=2, rdzv_endpoint="h:1"))
    assert "--nproc_per_node=2" in argv and "--nnodes=2" in argv and "device=cpu" in argv


def test_an_elastic_range_is_torchruns_min_max_with_a_store_per_round():
    elastic = req(gpus=0, procs=2, nodes=1, max_nodes=3, rdzv_endpoint="h:1", max_restarts=3)
    assert elastic.world_sizes == [2, 4, 6]
    assert render.local(elastic) == [
        "env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        PY, "-m", "engine.torchrun", "--nnodes=1:3", "--nproc_per_node=2",
        "--max-restarts=3", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--rdzv_id=RUN",
        "-m", "engine.train", "digits", "device=cpu", "run.name=RUN",
    ]  # fmt: skip
    docker = render.docker_run(elastic)
    assert "--network=host" in docker  # even from one node: others may join
    assert docker[docker.index("img:1") + 1 :][:3] == ["env", f"{render.FRESH_STORE}=1", "python"]
    # sbatch would fix the task count at MIN nodes' worth: the step asks per node instead.
    options = render.job_options(elastic)
    assert options["nodes"] == "1-3" and "ntasks_per_node" not in options
    script = render.sbatch_script(elastic)
    assert "#SBATCH --nodes=1-3\n" in script and "ntasks-per-node" not in script.split("srun")[0]
    assert "srun --unbuffered --kill-on-bad-exit=1 --ntasks-per-node=2 " in script
    fixed = req(gpus=0, nodes=2, rdzv_endpoint="h:1")
    assert fixed.world_sizes == [2] and render.local(fixed)[0] == PY  # no store switch


def test_max_restarts_is_torchruns_flag_on_every_torchrun_target():
    plain = {
        "standalone": render.local(req(gpus=2, max_restarts=3)),
        "multi-node": render.local(req(gpus=2, nodes=2, rdzv_endpoint="h:1", max_restarts=3)),
        "docker": render.docker_run(req(gpus=2, max_restarts=3)),
        "apptainer": render.apptainer(req(gpus=2, max_restarts=3)),
    }
    for target, argv in plain.items():
        i = argv.index("engine.torchrun")
        assert argv[i + 1 : argv.index("engine.train")].count("--max-restarts=3") == 1, target


def test_max_restarts_zero_leaves_the_flag_out_and_one_process_plain():
    assert not any("max-restarts" in a for a in render.local(req(gpus=2, max_restarts=0)))
    assert render.local(req(gpus=1)) == [PY, "-m", "engine.train", "digits", "run.name=RUN"]


def test_one_process_with_restarts_runs_under_torchrun_which_restarts_it():
    argv = render.local(req(gpus=1, max_restarts=2))
    assert argv[:6] == [
        PY, "-m", "engine.torchrun", "--standalone", "--nproc_per_node=1", "--max-restarts=2"
    ]  # fmt: skip


def test_multi_node_without_endpoint_is_refused():
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        render.local(req(gpus=2, nodes=2))


@pytest.mark.parametrize(
    "gpus,procs,nodes,per_node,world", [(0, 1, 1, 1, 1), (0, 4, 2, 4, 8), (8, 1, 2, 8, 16)]
)
def test_processes_per_node_and_world_size(gpus, procs, nodes, per_node, world):
    r = req(gpus=gpus, procs=procs, nodes=nodes)
    assert (r.procs_per_node, r.world_size) == (per_node, world)


def test_run_name_given_by_the_user_is_kept_and_not_duplicated():
    argv = render.local(req(gpus=0, run_name="mine", overrides=("run.name=mine",)))
    assert count(argv, "run.name=mine") == 1
    assert not [a for a in argv if a.startswith("run.name=") and a != "run.name=mine"]


def test_device_given_by_the_user_wins_over_device_cpu():
    argv = render.local(req(gpus=0, overrides=("device=cuda",)))
    assert "device=cpu" not in argv and argv[-1] == "device=cuda"


def test_overrides_come_last_in_order():
    argv = render.local(req(gpus=1, overrides=("b=1", "a=2", "b=3")))
    assert argv[-3:] == ["b=1", "a=2", "b=3"]


# ---------------------------------------------------------------- containers


def test_docker_run_gpus_mounts_user_and_secrets_by_name(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "s3cret-value")
    argv = render.docker_run(req(gpus=2, uid_gid="1000:1000", data="/big/data"))
    assert argv[:5] == ["docker", "run", "--rm", "--pull=never", "--ipc=host"]
    assert "--gpus=2" in argv
    assert argv[argv.index("-u") + 1] == "1000:1000"
    vols = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert vols == ["/src:/workspace", "/big/data:/data"]  # runs/ is inside the checkout
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        assert name in envs  # by name: docker copies the caller's value
    assert "RECIPES_DATA=/data" in envs
    assert not any("s3cret" in a for a in argv)
    inner = argv[argv.index("img:1") + 1 :]
    assert inner[: len(FLIGHT_RECORDER)] == FLIGHT_RECORDER  # NCCL's, set inside
    inner = inner[len(FLIGHT_RECORDER) :]
    assert inner[:5] == [
        "python",
        "-m",
        "engine.torchrun",
        "--standalone",
        "--nproc_per_node=2",
    ]
    assert PY not in argv  # the image's python, not the host venv's


def test_docker_cpu_has_no_gpus_flag_and_device_cpu():
    argv = render.docker_run(req(gpus=0))
    assert not any(a.startswith("--gpus") for a in argv)
    assert argv[argv.index("img:1") + 1 :] == [
        "python", "-m", "engine.train", "digits", "device=cpu", "run.name=RUN"
    ]  # fmt: skip


def test_docker_multi_node_uses_host_network_and_rendezvous():
    argv = render.docker_run(req(gpus=8, nodes=2, rdzv_endpoint="n1:29500"))
    assert "--network=host" in argv and "--rdzv_endpoint=n1:29500" in argv


WANDB_ENV = [
    "WANDB_API_KEY", "WANDB_DIR", "WANDB_ENTITY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_GROUP"
]  # fmt: skip


def env_flags(names):
    return [flag for name in names for flag in ("-e", name)]


def test_docker_multi_node_gpus_exact_argv_as_nvidia_runs_pytorch():
    r = req(
        gpus=8, nodes=2, rdzv_endpoint="n1:29500", uid_gid="1000:1000", infiniband=True,
        passthrough_env=("NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "WANDB_MODE", "NCCL_DEBUG"),
    )  # fmt: skip
    names = sorted(["NCCL_DEBUG", "NCCL_SOCKET_IFNAME", *WANDB_ENV])
    assert render.docker_run(r) == [
        "docker", "run", "--rm", "--pull=never", "--ipc=host",
        "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
        "--gpus=8", "--network=host", "--device=/dev/infiniband", "-u", "1000:1000",
        "-v", "/src:/workspace", "-v", "/src/data:/data",
        "-w", "/workspace", "-e", "RECIPES_DATA=/data", *env_flags(names),
        "img:1", *FLIGHT_RECORDER, "python", "-m", "engine.torchrun", "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d", "--rdzv_endpoint=n1:29500", "--rdzv_id=RUN",
        "-m", "engine.train", "digits", "run.name=RUN",
    ]  # fmt: skip


def test_docker_one_gpu_has_the_ulimits_and_no_infiniband_unless_the_host_has_it():
    assert render.docker_run(req(gpus=1)) == [
        "docker", "run", "--rm", "--pull=never", "--ipc=host",
        "--ulimit", "memlock=-1", "--ulimit", "stack=67108864", "--gpus=1",
        "-v", "/src:/workspace", "-v", "/src/data:/data",
        "-w", "/workspace", "-e", "RECIPES_DATA=/data", *env_flags(WANDB_ENV),
        "img:1", "python", "-m", "engine.train", "digits", "run.name=RUN",
    ]  # fmt: skip


def test_docker_one_node_cpu_exact_argv_has_no_ulimits():
    """No NCCL on one CPU node, and rootless docker cannot raise the locked-memory limit."""
    assert render.docker_run(req(gpus=0, run_root="/scratch/runs")) == [
        "docker", "run", "--rm", "--pull=never", "--ipc=host",
        "-v", "/src:/workspace", "-v", "/src/data:/data", "-v", "/scratch/runs:/scratch/runs",
        "-w", "/workspace", "-e", "RECIPES_DATA=/data", *env_flags(WANDB_ENV),
        "img:1", "python", "-m", "engine.train", "digits", "device=cpu", "run.name=RUN",
    ]  # fmt: skip


def test_docker_cpu_on_several_nodes_has_the_ulimits_too():
    argv = render.docker_run(req(gpus=0, nodes=2, rdzv_endpoint="n1:1"))
    assert argv[5:9] == ["--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]


@pytest.mark.parametrize("name", ["NCCL_DEBUG=INFO", "", "1NCCL", "NCCL DEBUG", "A;touch x"])
def test_docker_passthrough_takes_names_only(name):
    with pytest.raises(ValueError, match="not a variable name"):
        render.docker_run(req(passthrough_env=(name,)))


@pytest.mark.parametrize(
    "run_root,mount",
    [
        ("runs", None),  # inside the mounted checkout: no mount of its own
        ("./out/runs", None),
        ("/scratch/runs", "/scratch/runs:/scratch/runs"),
        ("../runs", "/runs:/runs"),  # climbs out of the checkout (/src/../runs = /runs)
    ],
)
def test_each_folder_is_mounted_once_in_every_container(run_root, mount):
    r = req(src="/src", run_root=run_root)
    expected = ["/src:/workspace", "/src/data:/data", *([mount] if mount else [])]
    argv = render.docker_run(r)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-v"] == expected
    pyxis = render.pyxis(r)
    assert f"--container-mounts={','.join(expected)}" in pyxis
    apptainer = render.apptainer(r)
    assert apptainer[apptainer.index("--bind") + 1] == ",".join(expected)


def test_docker_relative_data_is_under_the_checkout_and_absolute_run_root_kept():
    argv = render.docker_run(req(gpus=0, data="data", run_root="/scratch/runs"))
    vols = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert "/src/data:/data" in vols and "/scratch/runs:/scratch/runs" in vols


def test_pyxis_srun_one_task_per_gpu_in_the_container():
    slurm = Slurm(partition="gpu", account="acct", time_min=30, cpus_per_task=8)
    argv = render.pyxis(req(gpus=4, nodes=2, slurm=slurm))
    assert argv[0] == "srun"
    for flag in (
        "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--partition=gpu",
        "--account=acct", "--time=30", "--cpus-per-task=8", "--container-image=img:1",
        "--container-workdir=/workspace", "--signal=USR2@120",
        "--container-mounts=/src:/workspace,/src/data:/data",
    ):  # fmt: skip
        assert flag in argv, flag
    i = argv.index("python")
    assert argv[i:] == ["python", "-m", "engine.train", "digits", "run.name=RUN"]
    assert "engine.torchrun" not in argv  # SLURM starts the ranks


def test_pyxis_cpu_tasks_are_procs_without_gpus():
    argv = render.pyxis(req(gpus=0, procs=3))
    assert "--ntasks-per-node=3" in argv and "device=cpu" in argv
    assert not any(a.startswith("--gpus") for a in argv)


@pytest.mark.parametrize("gpus,nv", [(0, False), (1, True), (4, True)])
def test_apptainer_exec_nv_only_with_gpus(gpus, nv):
    argv = render.apptainer(req(gpus=gpus, sif="/img/r.sif"))
    assert argv[:2] == ["apptainer", "exec"]
    assert ("--nv" in argv) is nv
    assert argv[argv.index("--bind") + 1] == "/src:/workspace,/src/data:/data"
    assert argv[argv.index("--pwd") + 1] == "/workspace"
    assert argv[argv.index("/img/r.sif") + 1] == ("env" if gpus > 1 else "python")  # NCCL's


def documented_commands(path: Path) -> list[str]:
    """Each command of a Markdown file's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def test_the_documented_multi_node_apptainer_command_is_what_renders(capsys):
    """docs/container.md: apptainer on 2 nodes is torchrun with a c10d rendezvous inside one
    `apptainer exec` per node (not SLURM's ranks), printed by the documented render command."""
    lines = documented_commands(ROOT / "docs" / "container.md")
    (ask,) = [x for x in lines if x.startswith("python -m launch render --target apptainer")]
    (shown,) = [x for x in lines if x.startswith("apptainer exec")]
    assert cli.main(shlex.split(ask)[3:], env={}) == 0
    printed = shlex.split(capsys.readouterr().out)
    assert printed == [w.replace("$PWD", str(ROOT)) for w in shlex.split(shown)]
    assert "--nnodes=2" in printed and "--standalone" not in printed


def test_image_build_records_sha_lock_and_tag_under_buildkit():
    argv = render.image_build(req(image="recipes:abc"), "f" * 40, "0" * 64)
    assert argv[:4] == ["env", "DOCKER_BUILDKIT=1", "docker", "build"]  # the Dockerfile mounts
    args = [argv[i + 1] for i, a in enumerate(argv) if a == "--build-arg"]
    assert args == [f"GIT_SHA={'f' * 40}", f"LOCK_SHA256={'0' * 64}", "IMAGE_TAG=recipes:abc"]
    assert "--secret" not in argv and "--network" not in argv
    assert argv[argv.index("-t") + 1] == "recipes:abc"
    assert argv[-3:] == ["-f", "/src/Dockerfile", "/src"]


def test_image_build_takes_the_sites_base_network_and_secrets_by_name():
    site = Docker(
        client="/usr/bin/docker", network="host", base_image="base:1", ca_bundle="/etc/ca.pem",
        pip_settings=("PIP_INDEX_URL", "PIP_TRUSTED_HOST"),
    )  # fmt: skip
    argv = render.image_build(req(image="recipes:abc", docker=site), "f" * 40, "0" * 64)
    assert argv[2:6] == ["/usr/bin/docker", "build", "--network", "host"]
    args = [argv[i + 1] for i, a in enumerate(argv) if a == "--build-arg"]
    assert args[0] == "BASE_IMAGE=base:1"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--secret"] == [
        "id=ca_bundle,src=/etc/ca.pem",
        "id=pip_index_url,env=PIP_INDEX_URL",
        "id=pip_trusted_host,env=PIP_TRUSTED_HOST",
    ]


@pytest.mark.parametrize(
    "site", [Docker(ca_bundle="/a,b/ca.pem"), Docker(pip_settings=("PIP_INDEX_URL=x",))]
)
def test_image_build_refuses_a_secret_docker_would_misread(site):
    with pytest.raises(ValueError):
        render.image_build(req(docker=site), "f" * 40, "0" * 64)


def test_docker_run_uses_the_named_client_and_network():
    argv = render.docker_run(req(docker=Docker(client="/opt/docker", network="host")))
    assert argv[0] == "/opt/docker" and "--network=host" in argv
    assert "--network=host" not in render.docker_run(req())
    with pytest.raises(ValueError, match="several nodes needs the host's network"):
        render.docker_run(req(nodes=2, rdzv_endpoint="n:1", docker=Docker(network="none")))


def test_sif_build_from_the_docker_daemon():
    assert render.sif_build(req(image="recipes:abc", sif="recipes.sif")) == [
        "apptainer", "build", "--force", "recipes.sif", "docker-daemon://recipes:abc"
    ]  # fmt: skip


# ---------------------------------------------------------------- the sbatch script


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_sbatch_directives():
    slurm = Slurm(
        partition="gpu", account="acct", qos="high", time_min=90, cpus_per_task=10,
        mem_gb=64, constraint="h100", exclude="bad1", signal_delay_s=300,
    )  # fmt: skip
    script = render.sbatch_script(req(gpus=8, nodes=2, slurm=slurm))
    lines = sbatch_lines(script)
    for line in (
        "--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=10",
        "--mem=64G", "--time=90", "--partition=gpu", "--account=acct", "--qos=high",
        "--constraint=h100", "--exclude=bad1", "--signal=USR2@300", "--requeue",
        "--open-mode=append", "--chdir=/src",
        "--output=runs/digits/RUN/slurm/%j.out", "--error=runs/digits/RUN/slurm/%j.err",
    ):  # fmt: skip
        assert f"#SBATCH {line}" in lines, line
    assert script.startswith("#!/bin/bash\n")


def test_sbatch_cpu_tasks_are_procs_and_no_gpus():
    script = render.sbatch_script(req(gpus=0, procs=4))
    assert "#SBATCH --ntasks-per-node=4" in sbatch_lines(script)
    assert not any("gpus" in line for line in sbatch_lines(script))
    assert "device=cpu" in script


def test_sbatch_unset_options_are_absent():
    lines = sbatch_lines(render.sbatch_script(req(gpus=1)))
    for key in ("partition", "account", "qos", "mem", "constraint", "exclude", "cpus-per-task"):
        assert not any(line.startswith(f"#SBATCH --{key}=") for line in lines), key


def test_sbatch_setup_lines_and_srun_cpus_come_before_srun():
    slurm = Slurm(setup=("module load cuda", "source .venv/bin/activate"), cpus_per_task=4)
    script = render.sbatch_script(req(gpus=2, slurm=slurm)).splitlines()
    srun = next(i for i, line in enumerate(script) if line.startswith("srun "))
    assert script.index("{ module load cuda") < srun
    assert script.index('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"') < srun


def test_sbatch_rejects_a_line_break_in_a_directive():
    with pytest.raises(ValueError, match="line break"):
        render.sbatch_script(req(slurm=Slurm(partition="gpu\nrm -rf x")))


def fake_bin(folder: Path, name: str) -> None:
    """A program that appends its argv (NUL-separated, one record per call) to $FAKE_LOG."""
    path = folder / name
    path.write_text(
        "#!/bin/bash\n"
        # FAKE_PREEMPTED=NAME: that program is sent SLURM's preemption signals as it starts
        '[ "$(basename "$0")" = "${FAKE_PREEMPTED:-}" ] && kill -TERM $$ && kill -USR2 $$\n'
        '{ printf "%s\\0" "$(basename "$0")" "$@"; printf "\\n"; } >> "$FAKE_LOG"\n'
        'exit "${FAKE_RC:-0}"\n'
    )
    path.chmod(0o755)


def calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [rec.rstrip("\0").split("\0") for rec in log.read_text().split("\0\n") if rec]


def run_bash(script: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name in ("srun", "scontrol", "python", "docker", "apptainer", "env"):
        fake_bin(bindir, name)
    full = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "FAKE_LOG": str(tmp_path / "log"),
        "SLURM_JOB_ID": "4242",
        **env,
    }
    return subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=full, capture_output=True, text=True
    )


def test_sbatch_script_keeps_every_hostile_value_inert(tmp_path):
    r = hostile_request(python=hostile("python"))
    script = render.sbatch_script(r)
    done = run_bash(script, tmp_path)
    assert done.returncode == 0, done.stderr
    (srun,) = calls(tmp_path / "log")
    assert srun == [
        "srun", "--unbuffered", "--kill-on-bad-exit=1", r.python, "-m", "engine.train",
        *render.engine_args(r),
    ]  # fmt: skip
    assert srun[-4:-1] == [f"x={INJECT}", INJECT_KV, INJECT]
    assert_inert(srun, tmp_path)
    directives = {
        "job-name": f"{r.recipe}-{r.run_name}", "partition": r.slurm.partition,
        "account": r.slurm.account, "qos": r.slurm.qos, "constraint": r.slurm.constraint,
        "exclude": r.slurm.exclude, "chdir": r.src,
    }  # fmt: skip
    lines = {line.split("=")[0]: line for line in sbatch_lines(script)}
    for key, value in directives.items():  # each directive's value is one shell word
        assert shlex.split(lines[f"#SBATCH --{key}"]) == ["#SBATCH", f"--{key}={value}"], key


@pytest.mark.parametrize(
    "rc,restarts,requeued", [(75, "0", True), (75, "19", True), (75, "20", False), (0, "0", False)]
)
def test_sbatch_script_requeues_on_exit_75(tmp_path, rc, restarts, requeued):
    script = render.sbatch_script(req(gpus=1, python="python"))
    done = run_bash(script, tmp_path, FAKE_RC=str(rc), SLURM_RESTART_COUNT=restarts)
    assert done.returncode == rc  # scontrol (fake) exits 0; the script keeps the engine's code
    scontrol = [c for c in calls(tmp_path / "log") if c[0] == "scontrol"]
    assert scontrol == ([["scontrol", "requeue", "4242"]] if requeued else [])


def test_the_sbatch_requeue_survives_the_signals_of_the_preemption_that_asked_for_it(tmp_path):
    """SLURM signals every process of the job: a SIGTERM or SIGUSR2 reaching scontrol mid-
    request would leave the job FAILED instead of requeued."""
    script = render.sbatch_script(req(gpus=1, python="python"))
    done = run_bash(script, tmp_path, FAKE_RC="75", FAKE_PREEMPTED="scontrol")
    assert done.returncode == 75, done.stderr
    assert [c for c in calls(tmp_path / "log") if c[0] == "scontrol"] == [
        ["scontrol", "requeue", "4242"]
    ]


# ---------------------------------------------------------------- quoting, every target

# Pasted unquoted, this runs every touch (the quotes after '#' are a comment); quoted, none.
PAYLOAD = "pwned$(touch pwned1)`touch pwned2`;touch pwned3|touch pwned4&&touch pwned5 #'\""


def hostile(field: str) -> str:
    return f"{field}-{PAYLOAD}"


def hostile_request(**kw) -> LaunchRequest:
    """Every string a request carries holds the payload; `python` stays a program on PATH."""
    slurm = Slurm(
        **{k: hostile(k) for k in ("partition", "account", "qos", "constraint", "exclude")}
    )
    fields = dict(
        recipe=hostile("recipe"), run_name=hostile("run"), variant=hostile("variant"),
        overrides=(f"x={INJECT}", INJECT_KV, INJECT, f"note={PAYLOAD}\n{PAYLOAD}"),
        python="python", image=hostile("image"), sif=hostile("sif"), src=hostile("/src"),
        data=hostile("data"), run_root=hostile("runs"), uid_gid=hostile("uid"),
        rdzv_endpoint=hostile("rdzv"), slurm=slurm,
    )  # fmt: skip
    return req(**{**fields, **kw})


def assert_inert(argv: list[str], tmp_path: Path) -> None:
    """Nothing ran, and no value was split: an argument with part of the payload has all of it."""
    assert not list(tmp_path.glob("pwned*")) and not (tmp_path / "x").exists()
    assert all(PAYLOAD in a or a == INJECT_KV for a in argv if "pwned" in a)


# The docker client stays a program on PATH; the pip settings are variable names.
HOSTILE_DOCKER = Docker(
    network=hostile("net"), base_image=hostile("base"), ca_bundle=hostile("ca"),
    pip_settings=("PIP_INDEX_URL",),
)  # fmt: skip


def with_(**kw):
    return lambda r: LaunchRequest(**{**r.__dict__, **kw})


TARGETS = {
    "local cpu": render.local,
    "torchrun": lambda r: render.local(with_(gpus=2)(r)),
    "multi-node": lambda r: render.local(with_(gpus=2, nodes=2)(r)),
    "restarts": lambda r: render.local(with_(max_restarts=2)(r)),
    "docker": lambda r: render.docker_run(with_(docker=HOSTILE_DOCKER)(r)),
    "docker multi-node": lambda r: render.docker_run(with_(gpus=2, nodes=2)(r)),
    "pyxis": render.pyxis,
    "apptainer": render.apptainer,
    "image build": lambda r: render.image_build(
        with_(docker=HOSTILE_DOCKER)(r), hostile("sha"), hostile("lock")
    ),
    "sif build": render.sif_build,
}


@pytest.mark.parametrize("target", TARGETS)
def test_injection_stays_one_inert_argument(target, tmp_path):
    argv = TARGETS[target](hostile_request())
    if "engine.train" in argv:
        assert count(argv, INJECT) == 1 and count(argv, INJECT_KV) == 1
    printed = render.shell_join(argv)
    assert shlex.split(printed) == argv
    done = run_bash(printed, tmp_path)  # the printed line, pasted into a shell
    assert done.returncode == 0, done.stderr
    assert calls(tmp_path / "log") == [argv]
    assert_inert(argv, tmp_path)
