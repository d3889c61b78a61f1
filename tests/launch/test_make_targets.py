"""The Makefile as a user meets it: `make help` names every target and request variable, and
a target whose output is an artefact (make config > run.yaml, make sbatch > job.sh) prints
that alone on stdout, even on the first make of a fresh clone, which builds the venv."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, launch_env

MAKEFILE = (REPO / "Makefile").read_text()


def make(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *args], cwd=REPO, env=launch_env(**env),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_make_help_names_every_target_and_request_variable():
    targets = {t for line in re.findall(r"^\.PHONY:(.*)$", MAKEFILE, re.M) for t in line.split()}
    variables = {v for line in re.findall(r"^export (.*)$", MAKEFILE, re.M) for v in line.split()}
    done = make("help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    words = set(re.findall(r"[A-Za-z_][\w-]*", done.stdout))
    assert targets and targets <= words, sorted(targets - words)
    assert variables and variables <= words, sorted(variables - words)


def fake_python(tmp_path: Path) -> Path:
    """A `python3` that makes a venv whose pip talks on stdout, as pip does, and otherwise
    is the test's interpreter (which has everything installed)."""
    script = tmp_path / "python3"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0; fi\n'
        'if [ "$1 $2" = "-m pip" ]; then echo "Collecting torch==2.14.1 (pip on stdout)"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script


@pytest.mark.slow  # the engine resolves and checks the config: seconds
def test_the_first_make_config_and_make_sbatch_print_the_artefact_alone(tmp_path):
    python = fake_python(tmp_path)
    fresh = {"VENV": str(tmp_path / "venv"), "PYTHON": str(python)}  # a fresh clone's venv
    config = make("config", *(f"{k}={v}" for k, v in fresh.items()), RECIPE="digits")
    assert config.returncode == 0, config.stderr
    assert "pip on stdout" in config.stderr and "installing" in config.stderr  # said, aside
    assert yaml.safe_load(config.stdout)["recipe"] == "digits", config.stdout[:300]
    (tmp_path / "venv" / ".installed-lock").unlink()  # the lock changed: installed again
    args = f"run.root={tmp_path / 'runs'}"
    sbatch = make("sbatch", *(f"{k}={v}" for k, v in fresh.items()), GPUS="0", ARGS=args)
    assert sbatch.returncode == 0, sbatch.stderr
    assert sbatch.stdout.startswith("#!/bin/bash\n") and "pip on stdout" in sbatch.stderr
