"""`python -m launch` as a subprocess: dry runs, bad input, make, and a real (fake-engine) run."""

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.request import visible_gpu_count
from tests import helpers
from tests.helpers import launch, launch_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """\
seed: 0
train: {epochs: 1}
slurm:
  time_min: 20
  partition: from-config
  setup: ["echo setting up"]
"""
FAKE_TRAIN = """\
import json, os, sys
from pathlib import Path

def main(argv):
    with open(os.environ.get("FAKE_RECORD", os.devnull), "a") as f:
        f.write(json.dumps({"orig_argv": sys.orig_argv, "cwd": os.getcwd()}) + "\\n")
    if "--check" in argv:
        if os.environ.get("FAKE_CHECK_ERROR"):
            print("error: " + os.environ["FAKE_CHECK_ERROR"], file=sys.stderr)
        return 2 if os.environ.get("FAKE_CHECK_ERROR") else 0
    return int(os.environ.get("FAKE_RC", "0"))

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""
RUN_NAME = re.compile(r"run\.name=\d{8}-\d{6}-digits-[0-9a-f]{4}")


@pytest.fixture
def recipes(tmp_path):
    for name in ("digits", "other"):
        (tmp_path / "recipes" / name).mkdir(parents=True)
        (tmp_path / "recipes" / name / "config.yaml").write_text(CONFIG)
    return tmp_path / "recipes"


# The repository's recipes, for a dry run in the fast checkout below.
REAL_RECIPES = {"RECIPES_DIR": str(ROOT / "recipes")}


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> Path:
    """A checkout whose engine passes its check at once: for dry runs whose subject is what
    launch prints, not the engine's check (tests/launch/test_request_checks.py has that)."""
    return helpers.fake_checkout(tmp_path_factory.mktemp("fast") / "checkout", FAKE_TRAIN, CONFIG)


def one_line(out: str) -> str:
    lines = out.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0], out
    return lines[0]


# ---------------------------------------------------------------- dry runs


def test_dry_run_cpu_is_the_venv_python_with_device_cpu_and_a_fresh_name(recipes, fast):
    done = [launch("train", cwd=fast, DRY_RUN="1", GPUS="0", RECIPES_DIR=str(recipes))
            for _ in range(2)]  # fmt: skip
    assert done[0].returncode == 0, done[0].stderr
    argv = shlex.split(one_line(done[0].stdout))
    assert argv[:5] == [sys.executable, "-m", "engine.train", "digits", "device=cpu"]
    assert RUN_NAME.fullmatch(argv[5]) and len(argv) == 6
    # two launches never share a run name
    assert RUN_NAME.search(done[1].stdout) and done[0].stdout != done[1].stdout


def test_a_machine_without_gpus_does_not_pin_the_device_only_gpus_0_asks_for_cpu(recipes, fast):
    # GPUS unset on a host without GPUs (a login node): the machine decides, device=auto.
    done = launch("train", cwd=fast, DRY_RUN="1", RECIPES_DIR=str(recipes), CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr
    assert not [a for a in shlex.split(one_line(done.stdout)) if a.startswith("device=")]


def test_flags_win_over_environment_and_overrides_after_args(recipes):
    # render: the pure renderer (a dry run would also have the engine check these keys)
    done = launch(
        "render", "--gpus", "4", "--recipe", "other", "--", "b=2", "c=--x",
        GPUS="0", RECIPE="digits", ARGS="a=1 run.name=kept", RECIPES_DIR=str(recipes),
    )  # fmt: skip
    argv = shlex.split(one_line(done.stdout))
    assert "--nproc_per_node=4" in argv
    assert argv[argv.index("engine.train") + 1 :] == [
        "other", "device=cuda", "a=1", "run.name=kept", "b=2", "c=--x"
    ]  # fmt: skip


def test_args_with_a_hostile_value_stay_one_argument(recipes):
    hostile = 'note="; rm -rf x" $(touch pwned)'
    done = launch("render", GPUS="0", ARGS=shlex.quote(hostile), RECIPES_DIR=str(recipes))
    argv = shlex.split(one_line(done.stdout))
    assert argv[-1] == hostile


def test_render_targets_print_one_command(recipes):
    for target, first in [("docker", "docker"), ("pyxis", "srun"), ("apptainer", "apptainer")]:
        done = launch("render", "--target", target, GPUS="1", RECIPES_DIR=str(recipes))
        assert shlex.split(one_line(done.stdout))[0] == first, done.stderr


def test_target_from_the_environment_and_the_flag_over_it(recipes, fast):
    done = launch(
        "train", cwd=fast, DRY_RUN="1", GPUS="0", TARGET="apptainer", RECIPES_DIR=str(recipes)
    )
    assert shlex.split(one_line(done.stdout))[:2] == ["apptainer", "exec"]
    done = launch(
        "train", "--target", "local", cwd=fast, DRY_RUN="1", GPUS="0", TARGET="docker",
        RECIPES_DIR=str(recipes),
    )  # fmt: skip
    assert shlex.split(one_line(done.stdout))[0] == sys.executable


def test_docker_train_default_image_is_the_git_short_sha(recipes):
    sha = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    done = launch("docker-train", DRY_RUN="1", GPUS="2", RECIPES_DIR=str(recipes))
    argv = shlex.split(one_line(done.stdout))
    assert f"recipes:{sha}" in argv and "--gpus=2" in argv


def test_image_build_args(recipes):
    done = launch("image", DRY_RUN="1", IMAGE="recipes:x", RECIPES_DIR=str(recipes))
    argv = shlex.split(one_line(done.stdout))
    lock = hashlib.sha256((ROOT / "requirements.lock").read_bytes()).hexdigest()
    assert f"LOCK_SHA256={lock}" in argv and "IMAGE_TAG=recipes:x" in argv
    assert argv[argv.index("-t") + 1] == "recipes:x"


def test_submit_dry_run_prints_the_sbatch_script_env_over_config(recipes, fast):
    done = launch(
        "submit", "--dry-run", cwd=fast, GPUS="0", PROCS="2", PARTITION="from-env",
        RECIPES_DIR=str(recipes),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert script.startswith("#!/bin/bash\n")
    for line in ("--partition=from-env", "--time=20", "--ntasks-per-node=2", "--requeue"):
        assert f"#SBATCH {line}\n" in script
    assert "\n{ echo setting up\n} || " in script


def make_dry_run(recipes, *variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "dry-run", *variables],
        cwd=ROOT,
        env=launch_env(RECIPES_DIR=str(recipes)),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_make_dry_run_cpu_processes(recipes):
    done = make_dry_run(recipes, "RECIPE=digits", "GPUS=0", "PROCS=2")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(one_line(done.stdout))
    assert argv[1:5] == ["-m", "engine.torchrun", "--standalone", "--nproc_per_node=2"]
    assert argv[5:9] == ["-m", "engine.train", "digits", "--resolved"]  # resolved once, here
    assert re.fullmatch(
        r"runs/digits/\d{8}-\d{6}-digits-[0-9a-f]{4}/request/[0-9a-f]{12}\.yaml", argv[9]
    )
    assert len(argv) == 10 and not (ROOT / argv[9]).exists()  # written as it runs
    note = f"launch: note: --resolved {argv[9]}: resolved from digits device=cpu run.name="
    assert done.stderr.startswith(note), done.stderr  # what the file will hold, said apart


def test_make_exports_max_restarts_to_torchrun(recipes):
    done = make_dry_run(recipes, "GPUS=0", "PROCS=2", "MAX_RESTARTS=3")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(one_line(done.stdout))
    assert argv[3:6] == ["--standalone", "--nproc_per_node=2", "--max-restarts=3"]


def test_make_dry_run_of_a_node_range_gives_torchrun_a_restart_budget(recipes):
    done = make_dry_run(  # the batch divides over 2, 3 and 4 in whole micro batches
        recipes, "GPUS=0", "NODES=2:4", "RDZV_ENDPOINT=node1:29400",
        "ARGS=run.name=el train.batch_size=48 train.micro_batch_size=4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    argv = shlex.split(one_line(done.stdout))
    assert argv[argv.index("engine.torchrun") + 1 :][:3] == [
        "--nnodes=2:4", "--nproc_per_node=1", "--max-restarts=3",
    ]  # fmt: skip


def test_max_restarts_flag_wins_over_the_environment(recipes, fast):
    done = launch(
        "dry-run", "--max-restarts", "0", cwd=fast, GPUS="0", PROCS="2", MAX_RESTARTS="5",
        RECIPES_DIR=str(recipes),
    )  # fmt: skip
    assert done.returncode == 0 and "max-restarts" not in done.stdout, done.stderr


# ---------------------------------------------------------------- bad input


BAD = {
    "unknown recipe": ({"RECIPE": "nope"}, [], "unknown recipe 'nope'; available: digits, other"),
    "recipe path": ({"RECIPE": "../digits"}, [], "RECIPE='../digits' is not a recipe name"),
    "recipe subfolder": ({"RECIPE": "digits/x"}, [], "is not a recipe name (letters, digits"),
    "recipe absolute": ({}, ["--recipe", "/etc"], "--recipe='/etc' is not a recipe name"),
    "recipe line break": ({"RECIPE": "digits\n"}, [], "no path); use one of: digits, other"),
    "gpus not a number": ({"GPUS": "abc"}, [], "GPUS='abc' is not a whole number"),
    "negative gpus": ({}, ["--gpus", "-1"], "--gpus='-1' is not a whole number >= 0"),
    "zero nodes": ({"NODES": "0"}, [], "NODES='0' is not a whole number >= 1"),
    "zero procs": ({"PROCS": "0", "GPUS": "0"}, [], "PROCS='0'"),
    "node range reversed": ({"NODES": "3:1"}, [], "NODES='3:1' is not a node range; an elastic"),
    "node range from zero": ({}, ["--nodes", "0:2"], "--nodes='0:2' is not a node range"),
    "node range of words": ({"NODES": "a:b"}, [], "NODES='a:b' is not a node range"),
    "node range needs rendezvous": (
        {"NODES": "1:2", "ARGS": "run.name=shared"},
        [],
        "NODES=1:2 runs this command on each node; set RDZV_ENDPOINT",
    ),
    "node range under pyxis": (
        {"NODES": "1:2"},
        ["--target", "pyxis"],
        "NODES=1:2: a node range needs a batch job, which SLURM can requeue",
    ),
    "node range without restarts": (
        {"NODES": "1:2", "ARGS": "run.name=e", "RDZV_ENDPOINT": "h:1", "MAX_RESTARTS": "0"},
        [],
        "NODES=1:2 restarts the workers when a node is lost, but MAX_RESTARTS=0 allows no",
    ),
    "procs with gpus": ({"GPUS": "2", "PROCS": "4"}, [], "PROCS=4 is for CPU runs"),
    "override without =": ({"ARGS": '"; rm -rf x"'}, [], "is not key=value"),
    "override is a word": ({}, ["--", "optim.lr"], "'optim.lr' is not key=value"),
    "unbalanced quote": ({"ARGS": "a='1"}, [], "ARGS cannot be split"),
    "bad run name": ({"ARGS": "run.name=a/b"}, [], "run.name='a/b'"),
    "multi-node needs rendezvous": ({"NODES": "2", "GPUS": "1"}, [], "RDZV_ENDPOINT=HOST:PORT"),
    "multi-node named, no rendezvous": (
        {"ARGS": "run.name=shared"},
        ["--nodes", "2"],
        "NODES=2 runs this command on each node",
    ),
    "bad endpoint": ({"RDZV_ENDPOINT": "nohost"}, [], "is not HOST:PORT"),
    "bad target": ({}, ["--target", "k8s"], "--target='k8s' is not one of"),
    "bad target env": ({"TARGET": "x86_64"}, [], "TARGET='x86_64' is not one of local"),
    "bad command": ({}, [], "invalid choice"),
    "no command": ({}, [], "no command given; one of: train, eval, dry-run, submit"),
    "bad slurm int": ({"TIME_MIN": "soon"}, [], "TIME_MIN='soon'"),
    "line break": ({"PARTITION": "a\nb"}, [], "PARTITION cannot contain a line break"),
    "seeds": ({"SEEDS": "0"}, [], "SEEDS='0' is not a whole number >= 1"),
    "negative restarts": (
        {"MAX_RESTARTS": "-1"},
        [],
        "MAX_RESTARTS='-1' is not a whole number >= 0",
    ),
    "restarts not a number": ({}, ["--max-restarts", "2.5"], "--max-restarts='2.5' is not a whole"),
    "restarts under slurm": ({"MAX_RESTARTS": "2"}, ["--target", "pyxis"], "SLURM starts this run"),
    "restarts submitted": ({"MAX_RESTARTS": "1"}, [], "leave it 0 (SLURM requeues"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2(case, recipes):
    env, args, message = BAD[case]
    commands = {
        "bad command": ["fly"],
        "line break": ["submit"],
        "seeds": ["sweep"],
        "restarts submitted": ["submit"],
    }
    command = commands.get(case, [] if case == "no command" else ["train"])
    env = {"GPUS": "0", "DRY_RUN": "1", "RECIPES_DIR": str(recipes), **env}
    done = launch(*command, *args, **env)
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = one_line(done.stderr)
    assert line.startswith("launch: ") and message in line, line
    assert "Traceback" not in done.stderr and done.stdout == ""


def fake_nvidia_smi(folder: Path, gpus: int) -> Path:
    """nvidia-smi -L listing `gpus` GPUs, each with a MIG line that is not a GPU of its own."""
    folder.mkdir(exist_ok=True)
    lines = "".join(
        f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})\\n  MIG 1g.18gb Device 0: (UUID: MIG-{i})\\n"
        for i in range(gpus)
    )
    (folder / "nvidia-smi").write_text(f'#!/bin/sh\nprintf "{lines}"\n')
    (folder / "nvidia-smi").chmod(0o755)
    return folder


@pytest.mark.parametrize(
    "mask, visible",
    [(None, 4), ("0,1", 2), ("3", 1), ("0,-1,2", 1), ("", 0), ("-1", 0), ("0,1,2,3,4,5", 4)],
)
def test_visible_gpus_are_the_installed_ones_narrowed_by_cuda_visible_devices(
    monkeypatch, tmp_path, mask, visible
):
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "bin", 4)))
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    assert visible_gpu_count() == visible


def test_more_gpus_than_visible_is_refused_before_anything_starts(fake_checkout, tmp_path):
    record = tmp_path / "rec"
    done = launch(
        "train", cwd=fake_checkout, GPUS="1", CUDA_VISIBLE_DEVICES="", FAKE_RECORD=str(record)
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    line = one_line(done.stderr)
    assert line == (
        "launch: GPUS=1 but 0 CUDA device(s) are visible here; "
        "set GPUS=0 for CPU processes (PROCS=N for N of them)"
    )
    assert not record.exists()  # the engine never started


@pytest.mark.parametrize("command", [["dry-run"], ["render", "--target", "local"]])
def test_a_dry_run_with_more_gpus_than_visible_prints_and_warns(recipes, fast, command):
    done = launch(*command, cwd=fast, GPUS="8", CUDA_VISIBLE_DEVICES="", RECIPES_DIR=str(recipes))
    assert done.returncode == 0
    assert "--nproc_per_node=8" in shlex.split(one_line(done.stdout))
    warning, *notes = done.stderr.splitlines()  # a dry run's note: what the processes read
    assert warning.startswith(
        "launch: warning: GPUS=8 but 0 CUDA device(s) are visible here; to run it here, set GPUS=0"
    )
    assert all(line.startswith("launch: note: --resolved ") for line in notes), notes


@pytest.mark.parametrize("gpus, warned", [("2", False), ("3", True)])
def test_gpus_up_to_the_visible_count_pass(fast, tmp_path, gpus, warned):
    bindir = fake_nvidia_smi(tmp_path / "bin", 2)
    path = f"{bindir}:{os.environ['PATH']}"  # 48: a batch that divides over 2 and 3
    done = launch(
        "dry-run", cwd=fast, GPUS=gpus, ARGS="train.batch_size=48", PATH=path, **REAL_RECIPES
    )
    assert done.returncode == 0 and f"--nproc_per_node={gpus}" in done.stdout
    assert (
        "GPUS=3 but 2 CUDA device(s) are visible here; to run it here, set GPUS=2 or fewer"
        in done.stderr
    ) is warned


def test_containers_and_slurm_are_not_checked_against_this_machines_gpus(recipes, fast):
    for command in (["render", "--target", "docker"], ["render", "--target", "pyxis"], ["submit"]):
        done = launch(
            *command,
            cwd=fast,
            GPUS="8",
            DRY_RUN="1",
            CUDA_VISIBLE_DEVICES="",
            RECIPES_DIR=str(recipes),
        )
        assert done.returncode == 0 and done.stderr == "", (command, done.stderr)


def test_unknown_recipe_lists_the_real_recipes_by_default():
    done = launch("train", RECIPE="nope", GPUS="0", DRY_RUN="1")
    assert done.returncode == 2 and "digits" in one_line(done.stderr)


def test_submit_without_sbatch_says_so_and_shows_the_dry_run(recipes, fast, tmp_path):
    done = launch("submit", cwd=fast, GPUS="0", RECIPES_DIR=str(recipes), PATH=str(tmp_path))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert "sbatch is not on PATH" in line and "submit --dry-run" in line
    printed = launch(
        "submit", "--dry-run", cwd=fast, GPUS="0", RECIPES_DIR=str(recipes), PATH=str(tmp_path)
    )
    assert printed.returncode == 0, printed.stderr  # no srun, no sbatch: the script all the same
    assert printed.stdout.startswith("#!/bin/bash\n") and "\nsrun " in printed.stdout


def test_a_missing_program_is_one_line(recipes, fast, tmp_path):
    done = launch("docker-train", cwd=fast, GPUS="0", RECIPES_DIR=str(recipes), PATH=str(tmp_path))
    assert done.returncode == 2
    assert "docker is not on PATH" in one_line(done.stderr)


# ---------------------------------------------------------------- running: exactly that argv


@pytest.fixture
def fake_checkout(tmp_path):
    """launch/ beside a fake engine that records how it was started."""
    return helpers.fake_checkout(tmp_path / "checkout", FAKE_TRAIN, CONFIG)


@pytest.mark.parametrize(
    ("env", "world"),
    [({"GPUS": "0", "PROCS": "3"}, "3"), ({"GPUS": "0", "MAX_RESTARTS": "1"}, "1")],
    ids=["3 processes", "under torchrun"],
)
def test_a_config_the_engine_refuses_starts_nothing(fake_checkout, tmp_path, env, world):
    refusal = "train.batch_size=64 does not divide over 3 processes; use a multiple"
    done = launch(
        "train", cwd=fake_checkout, FAKE_CHECK_ERROR=refusal, FAKE_RECORD=str(tmp_path / "rec"),
        **env,
    )  # fmt: skip
    assert done.returncode == 2
    where = "for one process" if world == "1" else f"for {world} process(es)"
    assert done.stderr == f"launch: {refusal} (config checked {where}; nothing was started)\n"
    (check,) = [json.loads(line) for line in (tmp_path / "rec").read_text().splitlines()]
    # a local run: its data must be on this machine; the config printed, which its processes
    # then read (resolved once)
    here = ["--check", world, "--data-here", "--print-config"]
    assert check["orig_argv"][-4:] == here


@pytest.mark.parametrize("rc", [0, 2, 75])
def test_train_runs_the_printed_command_and_returns_its_exit_code(fake_checkout, tmp_path, rc):
    env = dict(GPUS="0", ARGS="run.name=fixed 'note=a b'", FAKE_RECORD=str(tmp_path / "rec"))
    printed = launch("train", "--dry-run", cwd=fake_checkout, **env)
    assert printed.returncode == 0, printed.stderr
    (tmp_path / "rec").unlink()  # the dry run's check of the config
    done = launch("train", cwd=fake_checkout, FAKE_RC=str(rc), **env)
    assert done.returncode == rc, done.stderr
    # one process makes the engine's checks itself: no second start of python first
    (record,) = [json.loads(line) for line in (tmp_path / "rec").read_text().splitlines()]
    assert record["orig_argv"] == shlex.split(one_line(printed.stdout))
    assert record["cwd"] == str(fake_checkout)
    assert one_line(done.stderr) == "+ " + one_line(printed.stdout)


def test_docker_passes_the_callers_nccl_settings_by_name_only(recipes, fast):
    secretish = "mlx5_0:1"
    done = launch(
        "docker-train", cwd=fast, DRY_RUN="1", GPUS="1", NCCL_DEBUG="INFO", NCCL_IB_HCA=secretish,
        RECIPES_DIR=str(recipes),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    argv = shlex.split(one_line(done.stdout))
    passed = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert "NCCL_DEBUG" in passed and "NCCL_IB_HCA" in passed
    assert secretish not in done.stdout and "INFO" not in done.stdout


def test_submit_asks_for_the_recipes_gpus_not_this_machines(fast):
    """This machine shows no GPU; the job still asks for the 8 the recipe declares."""
    env = {k: v for k, v in launch_env().items() if k != "GPUS"} | REAL_RECIPES
    for command in (["submit"], ["sweep", "--slurm", "--seeds", "2"]):
        done = subprocess.run(
            [sys.executable, "-m", "launch", *command, "--dry-run", "--recipe", "imagenet"],
            cwd=fast, env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "#SBATCH --gpus-per-node=8\n" in done.stdout, command
        assert "#SBATCH --ntasks-per-node=8\n" in done.stdout, command
        assert "device=cpu" not in done.stdout and "device=cuda" in done.stdout, command


def test_a_cpu_submission_of_a_gpu_recipe_needs_an_explicit_yes(fast):
    refused = launch("submit", "--dry-run", cwd=fast, RECIPE="imagenet", GPUS="0", **REAL_RECIPES)
    assert refused.returncode == 2 and refused.stdout == ""
    assert one_line(refused.stderr) == (
        "launch: recipe imagenet declares slurm.gpus_per_node=8, but GPUS=0 asks SLURM for "
        "CPU tasks; leave GPUS unset for 8 GPU(s) per node, or set ALLOW_CPU=1 (--allow-cpu) "
        "to submit it on CPU anyway"
    )
    allowed = launch(
        "submit", "--dry-run", cwd=fast, RECIPE="imagenet", GPUS="0", ALLOW_CPU="1",
        **REAL_RECIPES,
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert "#SBATCH --gpus-per-node" not in allowed.stdout and "device=cpu" in allowed.stdout


def test_a_config_file_names_its_recipe_and_variant_for_launch_too(tmp_path, fast):
    saved = tmp_path / "config.yaml"  # as a run of `gpt --config 124m` saved it, in part
    saved.write_text("recipe: gpt\nvariant: 124m\nslurm:\n  time_min: 7\n")
    done = launch("submit", "--dry-run", cwd=fast, CONFIG=str(saved), **REAL_RECIPES)
    assert done.returncode == 0, done.stderr
    for line in ("--gpus-per-node=8", "--time=7"):  # 124m's GPUs, the file's time
        assert f"#SBATCH {line}\n" in done.stdout
    (task,) = [line for line in done.stdout.splitlines() if line.startswith("#   every task:")]
    argv = shlex.split(task.removeprefix("#   every task:"))
    assert argv[3:5] == ["gpt", "--resolved"] and "/request/" in argv[5]  # frozen at submission
    (asked,) = [line for line in done.stdout.splitlines() if ": resolved from " in line]
    assert shlex.split(asked.partition(": resolved from ")[2])[:3] == [
        "gpt",
        "--config",
        str(saved),
    ]
    assert re.search(r"run\.name=\d{8}-\d{6}-gpt-124m-[0-9a-f]{4}", asked)

    other = launch("train", "--dry-run", CONFIG=str(saved), RECIPE="digits")
    assert other.returncode == 2
    assert one_line(other.stderr) == (
        f"launch: CONFIG={saved} is a config of recipe 'gpt', but RECIPE='digits'; "
        "leave the recipe unset to run the file's"
    )
    missing = launch("train", "--dry-run", CONFIG=str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2
    nope = tmp_path / "nope.yaml"
    assert one_line(missing.stderr) == f"launch: CONFIG={nope}: config file {nope} not found"


def test_make_train_with_a_batch_that_does_not_divide_is_one_line_and_starts_nothing(tmp_path):
    """The real engine checks the digits config (global batch 64) for 3 processes."""
    done = launch("train", GPUS="0", PROCS="3", ARGS=f"run.root={tmp_path}")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("launch: train.batch_size=64 does not divide over 3 processes")
    assert line.endswith("(config checked for 3 process(es); nothing was started)")
    assert not list(tmp_path.iterdir())


def test_an_elastic_range_whose_batch_cannot_divide_at_every_size_is_one_line(tmp_path):
    """The real engine checks digits (global batch 64) for 1, 2 and 3 processes: 3 fails."""
    done = launch(
        "train", GPUS="0", NODES="1:3", RDZV_ENDPOINT="127.0.0.1:29400",
        ARGS=f"run.root={tmp_path} run.name=el train.micro_batch_size=16",
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        "launch: train.batch_size=64 does not divide over 3 processes, one of this elastic "
        "run's world sizes (1, 2, 3); use a multiple of 96 (their least common multiple times "
        "the micro batch, 16), e.g. train.batch_size=96"
    )
    assert line.endswith("(config checked for 1, 2 or 3 process(es); nothing was started)")
    assert not list(tmp_path.iterdir())


def test_a_local_run_whose_data_is_missing_is_one_line_and_starts_nothing(tmp_path):
    missing = tmp_path / "imagenet"
    done = launch("train", RECIPE="imagenet", GPUS="0", PROCS="2", ARGS=f"data.root={missing}")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"launch: data root {missing} not found: put ImageNet there as ")
    assert not missing.exists()


def test_make_config_prints_what_would_run_and_the_file_reruns_it(tmp_path):
    first = launch("config", RECIPE="gpt", CONFIG="124m", GPUS="0", ARGS="optim.lr=0.001")
    assert first.returncode == 0, first.stderr
    printed = yaml.safe_load(first.stdout)
    assert (printed["recipe"], printed["variant"]) == ("gpt", "124m")
    assert printed["optim"]["lr"] == 0.001 and printed["device"] == "cpu"
    assert printed["slurm"]["gpus_per_node"] == 0  # GPUS=0 asked: the file asks SLURM for none
    saved = tmp_path / "config.yaml"
    saved.write_text(first.stdout)
    again = launch("config", CONFIG=str(saved))
    assert again.returncode == 0, again.stderr
    rerun = yaml.safe_load(again.stdout)
    assert rerun["run"]["name"] == printed["run"]["name"] == ""  # names no run, as asked
    assert rerun == printed
