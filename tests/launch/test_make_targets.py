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

from launch import variables
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


def test_the_variables_are_listed_from_one_source_everywhere():
    """launch.variables writes make help's list, python -m launch --help's and the README's
    table; docs/config.md's table of SLURM shortcuts names its SLURM group, no more."""
    assert variables.help_text() in make("help").stdout
    shown = subprocess.run([sys.executable, "-m", "launch", "--help"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert shown.endswith(variables.help_text())
    readme = (REPO / "README.md").read_text()
    assert variables.markdown_table() in readme, "python -m launch.variables --markdown"
    config = (REPO / "docs" / "config.md").read_text()
    shortcuts = set(re.findall(r"^\| `([A-Z_]+)` \| `slurm\.", config, re.M))
    slurm = {n for v in variables.SLURM for n in v.names}
    request = {n for v in variables.REQUEST for n in v.names}  # GPUS, NODES: slurm.* too
    assert slurm <= shortcuts and shortcuts - slurm <= request, sorted(shortcuts ^ slurm)
    assert (
        "GPUS: GPUs per node; 0 = CPU [make train: 1 if a GPU is visible" in variables.help_text()
    )


@pytest.mark.parametrize(("given", "meant"), [("NODE=2", "NODES"), ("PARTITON=gpu", "PARTITION")])
def test_a_misspelt_request_variable_given_to_make_is_refused_with_the_name_it_meant(given, meant):
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "dry-run", given, "ARGS=train.max_steps=1"],
        cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    name = given.split("=")[0]
    (said,) = [line for line in done.stderr.splitlines() if line.startswith("launch:")]
    assert said == (
        f"launch: {name} is not a request variable; did you mean {meant}? (make help lists "
        "them; nothing was started)"
    )
    assert done.stdout == ""


def test_a_variable_close_to_none_of_ours_is_left_alone():
    assert variables.given_to_make(" -- CC=clang ARGS=a\\ b=c NODE=2") == ["CC", "ARGS", "NODE"]
    variables.check_make_variables({"MAKEFLAGS": "s -- CC=clang ARGS=x"})  # not ours: no error
