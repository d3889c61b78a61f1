"""What a cluster user asks is what runs: the saved config holds the request (not this
machine), slurm.* in ARGS reaches the scheduler, every target checks first, and a run's
checkpoint is scored with that run's request."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine import cli as engine_cli
from launch import check as launch_check
from launch import cli, render, request
from launch.request import SLURM_FLAGS
from tests.helpers import REPO, engine_env, engine_here, launch

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # a login node


def test_make_config_is_print_config_device_auto_and_no_run_name():
    made = launch("config", RECIPE="imagenet", **NO_GPU, timeout=120)
    printed = engine_here("imagenet", "--print-config", env=engine_env(**NO_GPU))
    assert made.returncode == 0 and printed.returncode == 0, made.stderr + printed.stderr
    assert made.stdout == printed.stdout
    assert "device: auto" in made.stdout and "  name: ''" in made.stdout


# Each SLURM key: (the config file's value, the variable's, ARGS's); ints or text.
VALUES = {
    name: ("7", "8", "9") if name in request.SLURM_INTS else ("file", "var", "args")
    for name in SLURM_FLAGS
}


@pytest.mark.parametrize("key", sorted(SLURM_FLAGS))
def test_slurm_precedence_is_args_then_variables_then_config_file_then_recipe(key, tmp_path):
    in_file, in_variable, in_args = VALUES[key]
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: digits\nslurm:\n  {key}: {in_file}\n")
    variable = SLURM_FLAGS[key][1]

    def asked(**env):
        args = cli.parse_args(["sbatch"])
        req = request.resolve(request.Asked.of(args, {"GPUS": "0", **env}), target="sbatch")
        return str(getattr(req.slurm, key))

    recipe = asked()
    assert asked(CONFIG=str(config)) == in_file != recipe
    assert asked(CONFIG=str(config), **{variable: in_variable}) == in_variable
    both = {variable: in_variable, "ARGS": f"slurm.{key}={in_args}"}
    assert asked(CONFIG=str(config), **both) == in_args


def test_slurm_keys_in_args_reach_the_batch_script_and_the_saved_config(tmp_path):
    done = launch(
        "sbatch", RECIPE="imagenet", GPUS="8", timeout=120,
        ARGS=f"slurm.time_min=30 slurm.partition=p slurm.constraint=a100 run.root={tmp_path}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "SIGNAL_DELAY_S" not in done.stderr  # 120 s ahead of a 30-minute limit: fine
    script = done.stdout
    for directive in ("--time=30", "--partition=p", "--constraint=a100"):
        assert f"#SBATCH {directive}\n" in script
    (srun,) = [line for line in script.splitlines() if "engine.train" in line]
    argv = shlex.split(srun)
    cfg = engine_cli.load(engine_cli.parse_argv(argv[argv.index("engine.train") + 1 :]))[0]
    assert (cfg.slurm.time_min, cfg.slurm.partition, cfg.slurm.constraint) == (30, "p", "a100")
    assert cfg.slurm.gpus_per_node == 8 and cfg.device == "cuda"  # GPUs asked: pinned
    frozen = argv[argv.index("--resolved") + 1]  # the request as submitted, written read-only
    assert frozen.startswith(f"{tmp_path}/imagenet/") and "/request/" in frozen
    assert not Path(frozen).stat().st_mode & 0o222


def test_a_checkpoint_warning_as_long_as_the_job_is_said_and_a_time_limit_named(tmp_path):
    """SIGNAL_DELAY_S (120 s) not shorter than TIME_MIN=1: the warning would come as the job
    starts; and a job SLURM ended at its limit says so in make status, not only SIGTERM."""
    from launch import watch

    done = launch("sbatch", GPUS="0", TIME_MIN="1", ARGS=f"run.root={tmp_path}", timeout=120)
    assert done.returncode == 0 and "#SBATCH --time=1\n" in done.stdout, done.stderr
    assert done.stderr.splitlines() == [
        "launch: warning: SIGNAL_DELAY_S=120 is not shorter than TIME_MIN=1 (60 s): the "
        "checkpoint warning would come as the job starts; lower SIGNAL_DELAY_S or raise TIME_MIN"
    ]
    status = watch.Status("r", "", "7")
    state = {"state": "stopped", "why": "preempted: SIGTERM", "exit_code": 75}
    info = {"JobState": "TIMEOUT", "TimeLimit": "00:01:00"}
    watch.decide(status, tmp_path, False, {}, state, {}, info, watch.SlurmQueue())
    assert status.state == "stopped" and status.notes == [
        "time limit 00:01:00 reached: raise TIME_MIN"
    ]


@pytest.mark.slow
def test_a_config_saved_where_gpus_were_asked_records_them_and_reruns_as_that_request(tmp_path):
    """make config GPUS=8 (on a GPU node or not) saves device=cuda and 8 GPUs per node, so
    submitting the file asks SLURM for them again."""
    made = launch("config", RECIPE="digits", GPUS="8", NODES="2", PARTITION="gpu", **NO_GPU)
    assert made.returncode == 0, made.stderr
    saved = yaml.safe_load(made.stdout)
    assert saved["device"] == "cuda"
    assert (saved["slurm"]["gpus_per_node"], saved["slurm"]["nodes"]) == (8, 2)
    assert saved["slurm"]["partition"] == "gpu"
    (tmp_path / "saved.yaml").write_text(made.stdout)
    args = cli.parse_args(["sbatch"])
    req = request.resolve(
        request.Asked.of(args, {"CONFIG": str(tmp_path / "saved.yaml")}), target="sbatch"
    )
    assert (req.gpus, req.nodes, req.slurm.partition) == (8, 2, "gpu")
    assert "#SBATCH --gpus-per-node=8" in render.sbatch_script(req)


@pytest.mark.slow
def test_a_task_that_sees_no_gpu_stops_in_one_line_instead_of_training_on_the_cpu(tmp_path):
    """What a GPU job's task runs (device=cuda pinned) on a node that shows no CUDA device."""
    done = subprocess.run(
        [sys.executable, "-m", "engine.train", "digits", "device=cuda", f"run.root={tmp_path}"],
        cwd=REPO, env=engine_env(**NO_GPU), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "device=cuda but no CUDA device is visible" in line, line
    assert "GPUs were asked for" in line and not (tmp_path / "digits").exists()


@pytest.mark.parametrize(
    "command, env, said",
    [
        (["submit"], {"ARGS": "train.epohcs=3"}, "unknown config key 'train.epohcs'"),
        (["sbatch"], {"RECIPE": "imagenet", "GPUS": "3"}, "does not divide over 3 processes"),
        (["sweep", "--slurm"], {"ARGS": "model.width=8,abc", "SEEDS": "1"}, "model.width"),
        (["train"], {"GPUS": "0", "ARGS": "train.epohcs=3"}, "unknown config key"),
    ],
    ids=["submit dry run", "sbatch", "slurm sweep dry run", "local dry run"],
)
def test_every_target_checks_first_dry_runs_included(command, env, said):
    done = launch(*command, DRY_RUN="1" if command[0] != "sbatch" else "", **env, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert said in line and line.endswith("nothing was started)"), line


@pytest.fixture
def imagenet_run(tmp_path):
    """A run directory as an imagenet run leaves it, as far as a look at it goes."""
    run = tmp_path / "runs" / "imagenet" / "ft1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: imagenet\nrun:\n  name: ft1\n")
    return run


def test_eval_of_another_recipe_s_checkpoint_names_its_recipe(imagenet_run, capsys):
    code = cli.main(["eval"], {"RECIPE": "digits", "CKPT": str(imagenet_run), "DRY_RUN": "1"})
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "is a checkpoint of recipe 'imagenet'" in line, line
    code = engine_cli.main(["digits", "--eval", str(imagenet_run / "checkpoints")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "is a checkpoint of recipe 'imagenet'" in line, line


def test_eval_of_a_run_renders_its_saved_config(imagenet_run, capsys, monkeypatch):
    checked = []  # the engine's check, answered here: the subject is the rendered command
    monkeypatch.setattr(launch_check, "run_check", lambda argv: checked.append(argv) or (0, "", ""))
    code = cli.main(["eval"], {"CKPT": str(imagenet_run), "DRY_RUN": "1", "GPUS": "0"})
    argv = shlex.split(capsys.readouterr().out)
    assert code == 0 and argv[argv.index("engine.train") + 1] == "imagenet"
    assert argv[argv.index("--config") + 1] == str(imagenet_run / "config.yaml")
    (asked,) = checked  # checked first, with the same saved config
    assert asked[asked.index("--config") + 1] == str(imagenet_run / "config.yaml")


def test_the_cpu_refusal_names_who_asked_for_the_gpus(tmp_path):
    """ALLOW_CPU's refusal names the layer that set slurm.gpus_per_node: a config file, a
    variant, ARGS, or the recipe."""
    asked = tmp_path / "gpus.yaml"
    asked.write_text("recipe: digits\nslurm:\n  gpus_per_node: 4\n")

    def refusal(**env: str) -> str:
        with pytest.raises(request.UserError) as err:
            request.resolve(
                request.Asked.of(cli.parse_args(["submit"]), {"GPUS": "0", **env}), target="submit"
            )
        return str(err.value)

    assert refusal(CONFIG=str(asked)).startswith(f"CONFIG={asked} sets slurm.gpus_per_node=4,")
    assert refusal(RECIPE="imagenet").startswith("recipe imagenet declares slurm.gpus_per_node=8")
    assert refusal(ARGS="slurm.gpus_per_node=2").startswith("ARGS sets slurm.gpus_per_node=2")
