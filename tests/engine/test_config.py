import subprocess
import sys

import pytest
import yaml

from engine import config as C
from engine.train import load_config
from tests.helpers import REPO, engine_env, run_dir, run_engine


def test_layers_defaults_recipe_then_overrides():
    cfg, _ = load_config("digits", ["optim.lr=0.2", "train.epochs=5", "model.width=8"])
    assert cfg.optim.lr == 0.2 and cfg.train.epochs == 5 and cfg.model.width == 8
    assert cfg.optim.name == "sgd"  # from the recipe's config.yaml
    assert cfg.train.amp == "auto"  # engine default the recipe does not set
    assert isinstance(cfg.optim.lr, float)


def test_override_values_are_yaml():
    tree = C.parse_overrides(["a.b=[1, 2]", "a.c=null", "d=off", "e=1e-3", "f="])
    assert tree == {"a": {"b": [1, 2], "c": None}, "d": False, "e": "1e-3", "f": ""}


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
        ("trian.epochs=2", "unknown config key 'trian'; did you mean 'train'?"),
        ("train.epochs=abc", "train.epochs: expected int, got 'abc'"),
        ("train.epochs=true", "train.epochs: expected int, got True"),
        ("optim.name=adam", "optim.name: 'adam' is not one of sgd, adamw"),
        ("optim.lr=-1", "optim.lr must be > 0"),
        ("foo", "override 'foo' is not key=value"),
        ("optim=3", "optim: expected a mapping"),
    ],
)
def test_bad_overrides_name_the_problem(override, message):
    with pytest.raises(C.ConfigError) as err:
        load_config("digits", [override])
    assert message in str(err.value)


def test_resolved_config_is_itself_a_valid_config():
    cfg, recipe = load_config("digits", ["optim.lr=0.3", "log.wandb=off", "slurm.setup=[a, b]"])
    saved = yaml.safe_load(C.dump(cfg))
    again = C.resolve(
        "digits", saved, [], {"model": recipe.model_config, "data": recipe.data_config}
    )
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["digits", "optim.lrr=1"], "did you mean 'optim.lr'"),
        (["digits", "train.batch_size=0"], "train.batch_size must be >= 1"),
        (["digits", "train.batch_size=63", "--spawn", "2"], "does not divide over 2 processes"),
        (["digits", "train.amp=fp16", "device=cpu"], "train.amp=fp16 needs a CUDA device"),
        (["nosuch"], "unknown recipe 'nosuch'; available: cifar10, digits, imagenet"),
        ([], "no recipe given"),
    ],
)
def test_cli_errors_exit_2_with_one_line_and_write_nothing(tmp_path, args, expected):
    cmd = [sys.executable, "-m", "engine.train", *args, f"run.root={tmp_path}", "log.wandb=off"]
    out = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env=engine_env(), timeout=120
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], out.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing written


def test_half_set_distributed_env_is_an_error(tmp_path):
    cmd = [sys.executable, "-m", "engine.train", "digits", f"run.root={tmp_path}"]
    env = engine_env(RANK="0", WORLD_SIZE="2")
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert "LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_resuming_a_run_with_another_model_is_a_one_line_error(tmp_path):
    run_engine(tmp_path, "w8", "model.width=8", "train.max_steps=2")
    before = sorted(p.name for p in (run_dir(tmp_path, "w8") / "checkpoints").iterdir())
    out = run_engine(tmp_path, "w8", "model.width=16", "train.max_steps=4", check=False)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit this model" in lines[0], out.stderr
    after = sorted(p.name for p in (run_dir(tmp_path, "w8") / "checkpoints").iterdir())
    assert after == before  # nothing lost or overwritten
