"""Recipe variants (CONFIG=NAME) through every entry point, on the real recipes: make, the
launch CLI, SLURM submission, and the engine itself."""

import shlex
import subprocess

import pytest

from engine import catalog
from engine import config as C
from engine.catalog import load_config
from tests.helpers import REPO, engine_here, launch, launch_env
from tests.launch.test_launch_cli import one_line


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", *args],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_imagenet_on_8_gpus_renders_the_8_process_torchrun():
    done = make("train", "RECIPE=imagenet", "GPUS=8", "DRY_RUN=1")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(one_line(done.stdout))
    assert argv[0] == "env" and "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in argv  # the flight recorder
    argv = argv[argv.index("-m") - 1 :]  # from the interpreter on
    assert argv[1:5] == ["-m", "engine.torchrun", "--standalone", "--nproc_per_node=8"]
    assert argv[5:8] == ["-m", "engine.train", "imagenet"] and "--config" not in argv


@pytest.mark.slow
def test_v2_submit_on_2_nodes_renders_the_job_with_the_variant_and_its_slurm_section():
    """GPUS unset: the variant's declared 8 GPUs per node, whatever this machine has."""
    done = make("submit", "RECIPE=imagenet", "CONFIG=v2", "DRY_RUN=1", "NODES=2")
    assert done.returncode == 0, done.stderr
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--time=4320"):
        assert f"#SBATCH {line}\n" in done.stdout  # --time from v2.yaml over config.yaml
    (task,) = [line for line in done.stdout.splitlines() if line.startswith("#   every task: ")]
    argv = shlex.split(task.removeprefix("#   every task: "))
    i = argv.index("imagenet")
    assert argv[i + 1] == "--resolved" and "/request/" in argv[i + 2]  # the frozen request
    (asked,) = [line for line in done.stdout.splitlines() if ": resolved from " in line]
    argv = shlex.split(asked.partition(": resolved from ")[2])
    assert argv[1:3] == ["--config", "v2"] and "device=cuda" in argv  # GPUs asked: cuda


@pytest.mark.parametrize("target", ["docker", "pyxis", "apptainer"])
def test_containers_carry_the_variant(target):
    done = launch("render", "--target", target, RECIPE="imagenet", CONFIG="budget", GPUS="8")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(one_line(done.stdout))
    i = argv.index("imagenet")
    assert argv[i + 1 : i + 3] == ["--config", "budget"]


def test_unknown_variant_is_one_line_naming_the_available_ones():
    done = launch("train", RECIPE="imagenet", CONFIG="v3", GPUS="0", DRY_RUN="1")
    assert done.returncode == 2
    assert "has no variant 'v3'; available: budget, finetune, v2" in one_line(done.stderr)
    engine = engine_here("cifar10", "--config", "v3")
    assert engine.returncode == 2
    assert one_line(engine.stderr) == (
        "error: recipe 'cifar10' has no variant 'v3'; available: fast, finetune"
    )


def test_make_recipes_lists_each_recipe_with_its_variants_and_descriptions():
    done = make("recipes")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split()[:2] == ["imagenet", "ResNet-50,"] for line in lines)
    variants = {line.split()[0] for line in lines if line.startswith(" ") and line.strip()}
    assert variants == {"fast", "v2", "budget", "124m", "1b", "finetune"}
    assert all(len(line.split()) > 2 for line in lines if line.startswith(" ") and line.strip())


def test_variant_layers_between_config_yaml_and_overrides():
    cfg, _ = load_config("imagenet", ["optim.lr=0.3"], "v2")
    assert cfg.variant == "v2" and cfg.optim.lr == 0.3  # override over the variant
    assert cfg.train.epochs == 600 and cfg.mix.cutmix_alpha == 1.0  # from v2.yaml
    assert cfg.optim.momentum == 0.9 and cfg.model.arch == "resnet50"  # from config.yaml
    with pytest.raises(C.ConfigError, match="chosen by name"):
        load_config("imagenet", ["variant=v2"])


def test_data_root_defaults_to_recipes_data_then_the_checkout(monkeypatch):
    # Decided where the data is read (catalog.data_here); the config keeps what was asked, so
    # a config saved on one machine does not pin that machine's path.
    monkeypatch.setenv("RECIPES_DATA", "/mnt/datasets")
    cfg = load_config("imagenet", [])[0]
    assert cfg.data.root == "" and catalog.data_here(cfg).root == "/mnt/datasets/imagenet"
    monkeypatch.delenv("RECIPES_DATA")
    cfg = load_config("cifar10", [])[0]
    assert catalog.data_here(cfg).root == str(REPO / "data" / "cifar10")
    assert catalog.data_here(load_config("cifar10", ["data.root=/x"])[0]).root == "/x"
