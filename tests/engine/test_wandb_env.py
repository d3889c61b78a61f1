"""W&B's own environment variables: WANDB_MODE, WANDB_PROJECT and WANDB_ENTITY set log.wandb,
log.project and log.entity (command line > environment > config files > engine default),
WANDB_DIR is where W&B writes, WANDB_RUN_GROUP is the run's group."""

import secrets
import subprocess

import pytest

from engine import cli
from engine.config import ConfigError, LogConfig
from engine.tracking import Tracker, wandb_env_overrides
from tests.helpers import engine_env, engine_process, run_dir


@pytest.mark.parametrize(
    ("mode", "log_wandb"),
    [("disabled", "off"), ("offline", "offline"), ("online", "online"), ("dryrun", "offline")],
)
def test_wandb_mode_maps_to_log_wandb(mode, log_wandb):
    assert wandb_env_overrides({"WANDB_MODE": mode}) == [f"log.wandb={log_wandb}"]


def test_project_and_entity_map_and_unset_or_empty_variables_set_nothing():
    env = {"WANDB_PROJECT": "p", "WANDB_ENTITY": "team", "WANDB_MODE": "", "WANDB_DIR": "/x"}
    assert wandb_env_overrides(env) == ["log.project=p", "log.entity=team"]
    assert wandb_env_overrides({}) == []


def test_an_unknown_wandb_mode_is_one_line_naming_the_variable_and_its_values():
    with pytest.raises(ConfigError) as err:
        wandb_env_overrides({"WANDB_MODE": "sometimes"})
    assert str(err.value) == (
        "WANDB_MODE='sometimes' is not one of disabled, offline, online, dryrun; fix or unset it"
    )


def resolved_log(monkeypatch, argv: list[str], **env: str) -> LogConfig:
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg, _ = cli.load(cli.parse_argv(argv))
    return cfg.log


def test_the_environment_wins_over_the_config_files(monkeypatch, tmp_path):
    assert resolved_log(monkeypatch, ["digits"]).wandb == "auto"  # the recipe's config
    log = resolved_log(monkeypatch, ["digits"], WANDB_MODE="disabled", WANDB_PROJECT="p")
    assert (log.wandb, log.project, log.entity) == ("off", "p", None)
    saved = tmp_path / "config.yaml"
    saved.write_text("recipe: digits\nlog:\n  wandb: online\n  project: f\n  entity: e\n")
    log = resolved_log(
        monkeypatch, ["--config", str(saved)], WANDB_MODE="offline", WANDB_ENTITY="t"
    )
    assert (log.wandb, log.project, log.entity) == ("offline", "f", "t")


def test_the_command_line_wins_over_the_environment(monkeypatch):
    argv = ["digits", "log.wandb=offline", "log.project=q", "log.entity=null"]
    env = {"WANDB_MODE": "disabled", "WANDB_PROJECT": "p", "WANDB_ENTITY": "t"}
    log = resolved_log(monkeypatch, argv, **env)
    assert (log.wandb, log.project, log.entity) == ("offline", "q", None)


def test_wandb_init_gets_wandb_dir_and_the_run_group(monkeypatch, tmp_path):
    import wandb  # start-up time: only this test needs it

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or object())
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    monkeypatch.setenv("WANDB_RUN_GROUP", "sweep-7")
    (tmp_path / "run").mkdir()
    Tracker(tmp_path / "run", LogConfig(), "online", {}, 0)
    (call,) = calls
    assert call["dir"] == str(tmp_path / "wandb-files") and call["group"] == "sweep-7"
    assert (tmp_path / "wandb-files").is_dir()
    monkeypatch.delenv("WANDB_DIR")
    monkeypatch.delenv("WANDB_RUN_GROUP")
    Tracker(tmp_path / "run", LogConfig(), "online", {}, 0)
    assert calls[1]["dir"] == str(tmp_path / "run") and calls[1]["group"] is None


def train(root, name: str, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    """digits for two steps with the recipe's log.wandb (auto) unless overridden."""
    base = {k: v for k, v in engine_env().items() if not k.startswith("WANDB_")}
    args = ["digits", "log.progress=plain", "device=cpu", "train.max_steps=2"]
    args += [f"run.root={root}", f"run.name={name}", *overrides]
    out = engine_process(*args, cwd=root, env=base | env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.slow
def test_wandb_mode_disabled_turns_wandb_off_for_a_recipe_that_says_auto(tmp_path):
    out = train(tmp_path, "quiet", WANDB_MODE="disabled")
    folder = run_dir(tmp_path, "quiet")
    assert (folder / "summary.json").exists()
    assert not (folder / "wandb").exists() and not (folder / "wandb-id.txt").exists()
    assert not list(tmp_path.rglob("*wandb*")) and "W&B" not in out.stderr


@pytest.mark.slow
def test_an_offline_run_writes_to_wandb_dir_in_its_group_and_no_key_anywhere(tmp_path):
    key = secrets.token_hex(20)
    shared = tmp_path / "shared-wandb"
    env = {"WANDB_MODE": "disabled", "WANDB_DIR": str(shared), "WANDB_RUN_GROUP": "sweep-7"}
    out = train(tmp_path, "grouped", "log.wandb=offline", WANDB_API_KEY=key, **env)
    folder = run_dir(tmp_path, "grouped")
    assert not (folder / "wandb").exists()  # W&B wrote to WANDB_DIR instead
    run_id = (folder / "wandb-id.txt").read_text().strip()
    (log_file,) = shared.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    assert b"sweep-7" in log_file.read_bytes()
    assert f"wandb sync {shared}/wandb/offline-run-*-{run_id}" in out.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert written == [] and key not in out.stdout + out.stderr
