"""Credentials in the environment reach no file of a run and none of its output, and one
pasted into an override is redacted wherever the engine records its command line."""

import secrets
from pathlib import Path

import pytest

from engine.tracking import redact
from tests.helpers import engine_env, run_dir, run_engine

CREDENTIALS = {
    name: secrets.token_hex(16)
    for name in (
        "WANDB_API_KEY",
        "HF_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "GITHUB_TOKEN",
        "DB_PASSWORD",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "PROXY_AUTH",
    )
}
PASTED = "GITHUB_TOKEN"  # also given on the command line, as a user might by mistake


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = run_engine(
        root,
        "secrets",
        "log.wandb=offline",
        "train.max_steps=3",
        f"slurm.account={CREDENTIALS[PASTED]}",  # a free-text field the engine only records
        env=engine_env(**CREDENTIALS),
    )
    return run_dir(root, "secrets"), (out.stdout + out.stderr).encode()


def holders(value: str, folder: Path, output: bytes) -> list[str]:
    """Every file under folder (W&B's binary logs too) and the output that contain value."""
    found = [str(p) for p in folder.rglob("*") if p.is_file() and value.encode() in p.read_bytes()]
    return found + (["process output"] if value.encode() in output else [])


@pytest.mark.slow
def test_credentials_in_the_environment_reach_no_file_and_no_output(run):
    folder, output = run
    assert list(folder.glob("wandb/offline-run-*/run-*.wandb"))  # W&B's files are searched
    for name, value in CREDENTIALS.items():
        if name != PASTED:
            assert holders(value, folder, output) == [], name


def written_by_train_py(path: str) -> bool:
    """config.yaml and the checkpoints' config (engine.assemble and engine.checkpoint.state)."""
    return path.endswith("config.yaml") or "/checkpoints/" in path


@pytest.mark.slow
def test_a_pasted_credential_is_redacted_from_env_json_wandb_and_output(run):
    folder, output = run
    assert f"slurm.account=<redacted {PASTED}>" in (folder / "env.json").read_text()
    found = holders(CREDENTIALS[PASTED], folder, output)
    assert [p for p in found if not written_by_train_py(p)] == []


@pytest.mark.slow
def test_a_pasted_credential_is_redacted_from_config_yaml_and_checkpoints(run):
    folder, output = run
    assert holders(CREDENTIALS[PASTED], folder, output) == []


def test_redact_reaches_into_nested_values_and_spares_short_values(monkeypatch):
    monkeypatch.setenv("MY_API_KEY", "k3y-0123456789")
    monkeypatch.setenv("FEATURE_AUTH", "1")  # too short to be a credential: left alone
    value = {"argv": ["x=k3y-0123456789", ("pre k3y-0123456789 post",)], "n": 1, "s": "v1"}
    assert redact(value) == {
        "argv": ["x=<redacted MY_API_KEY>", ("pre <redacted MY_API_KEY> post",)],
        "n": 1,
        "s": "v1",
    }
