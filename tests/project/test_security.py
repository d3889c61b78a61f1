"""Security rules the whole repository keeps, read from its syntax trees, and shell
metacharacters in request values staying inert from the CLI to the command that runs."""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
from pathlib import Path

import pytest

from launch import cli
from tests import helpers
from tests.helpers import launch
from tests.launch.test_launch_cli import CONFIG, FAKE_TRAIN, one_line
from tests.launch.test_render import PAYLOAD, calls, run_bash

ROOT = Path(__file__).resolve().parents[2]
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput")}
SHELL_CALLS |= {("subprocess", "getstatusoutput")}
LOADING_DIRS = ("engine", "launch", "recipes", "bench")


def python_files(folder: Path) -> list[Path]:
    """Every .py file of the repository under folder, tracked or new, as git lists them: not
    the virtual environment, nor runs/ (each run keeps a snapshot of the code it ran)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "*.py"],
        cwd=folder, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return sorted(p for p in {folder / n for n in listed.split("\0") if n} if p.is_file())


def dotted(node: ast.expr) -> tuple[str, ...]:
    """os.system -> ('os', 'system'); a plain name -> ('name',); anything else -> ()."""
    if isinstance(node, ast.Name):
        return (node.id,)
    if isinstance(node, ast.Attribute):
        return (*dotted(node.value), node.attr) if dotted(node.value) else ()
    return ()


def shell_uses(source: str) -> list[str]:
    """shell= anything but False, and calls (or imports) of os.system/os.popen and the
    subprocess helpers that always use a shell."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "shell":
            if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append(f"line {node.value.lineno}: shell={ast.unparse(node.value)}")
        if isinstance(node, ast.Call) and dotted(node.func)[-2:] in SHELL_CALLS:
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}()")
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "subprocess"):
            for alias in node.names:
                if (node.module, alias.name) in SHELL_CALLS:
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    return found


def unsafe_loads(source: str) -> list[str]:
    """torch.load( calls without weights_only=True (pickle runs arbitrary code on load)."""
    tree = ast.parse(source)
    aliases = {"torch.load"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "load"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ".".join(dotted(node.func)) in aliases:
            safe = [
                k
                for k in node.keywords
                if k.arg == "weights_only"
                and isinstance(k.value, ast.Constant)
                and k.value.value is True
            ]
            if not safe:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


# ---------------------------------------------------------------- the scanners bite


@pytest.mark.parametrize(
    "source",
    [
        "import subprocess\nsubprocess.run('ls', shell=True)",
        "subprocess.Popen(cmd, shell=flag)",
        "import os\nos.system('ls')",
        "os.popen('ls').read()",
        "from os import system",
        "import subprocess\nsubprocess.getoutput('ls')",
    ],
)
def test_the_shell_scan_finds(source):
    assert shell_uses(source)


def test_the_shell_scan_passes_argv_lists_and_references():
    source = "subprocess.run(['ls'], shell=False)\nsubprocess.run(['ls'])\nf = os.system"
    assert shell_uses(source) == []


@pytest.mark.parametrize(
    "source",
    [
        "torch.load(p)",
        "torch.load(p, weights_only=False)",
        "torch.load(p, weights_only=flag)",
        "from torch import load\nload(p)",
        "from torch import load as L\nL(p, map_location='cpu')",
    ],
)
def test_the_load_scan_finds(source):
    assert unsafe_loads(source)


def test_the_load_scan_passes_weights_only_true():
    assert unsafe_loads("torch.load(p, map_location='cpu', weights_only=True)") == []


# ---------------------------------------------------------------- the repository keeps them


def test_no_shell_anywhere_in_the_repository():
    files = python_files(ROOT)
    assert ROOT / "launch" / "cli.py" in files and not any(".venv" in p.parts for p in files)
    found = {str(p.relative_to(ROOT)): shell_uses(p.read_text()) for p in files}
    assert {path: uses for path, uses in found.items() if uses} == {}


def test_every_torch_load_is_weights_only():
    files = [p for folder in LOADING_DIRS for p in python_files(ROOT / folder)]
    found = {str(p.relative_to(ROOT)): unsafe_loads(p.read_text()) for p in files}
    assert {path: loads for path, loads in found.items() if loads} == {}


# ---------------------------------------------------------------- from the CLI to the shell

HOSTILE_ENV = {
    name: f"{name.lower()}-{PAYLOAD}"
    for name in ("IMAGE", "SIF", "RECIPES_DATA", "PARTITION", "ACCOUNT", "QOS", "CONSTRAINT")
}
HOSTILE_ENV |= {
    "EXCLUDE": f"exclude-{PAYLOAD}",
    # log.project: a text key the engine's check accepts as it is (a dry run is checked too)
    "ARGS": shlex.join([f"log.project={PAYLOAD}", f"run.root=/runs/{PAYLOAD}", "run.name=shared"]),
    "DRY_RUN": "1",
}
CLI_TARGETS = {  # programs on PATH, replaced by fakes that record their argv
    "docker": (["docker-train"], {"GPUS": "2"}),
    "docker multi-node": (["docker-train"], {"GPUS": "1", "NODES": "2", "RDZV_ENDPOINT": "n:1"}),
    "pyxis": (["render", "--target", "pyxis"], {"GPUS": "1"}),
    "apptainer": (["render", "--target", "apptainer"], {"GPUS": "0", "PROCS": "2"}),
    "image": (["image"], {}),
    "sif": (["sif"], {}),
}


def assert_no_payload_ran(argv: list[str], tmp_path: Path) -> None:
    assert not list(tmp_path.glob("pwned*"))
    assert all(PAYLOAD in a for a in argv if "pwned" in a)  # never split across arguments


@pytest.mark.parametrize("target", CLI_TARGETS)
def test_hostile_request_values_stay_inert_through_the_cli(target, tmp_path, capsys):
    command, env = CLI_TARGETS[target]
    assert cli.main([*command, "--dry-run"], {**HOSTILE_ENV, **env}) == 0
    printed = one_line(capsys.readouterr().out)
    done = run_bash(printed, tmp_path)
    assert done.returncode == 0, done.stderr
    (argv,) = calls(tmp_path / "log")
    assert argv == shlex.split(printed)
    assert_no_payload_ran(argv, tmp_path)
    values = [v for k, v in HOSTILE_ENV.items() if k not in ("ARGS", "DRY_RUN")]
    used = [v for v in values if any(v in a for a in argv)]
    assert used, "no hostile value reached the command"


def test_hostile_request_values_stay_inert_in_the_submitted_script(tmp_path, capsys):
    """The script submitit writes (the dry run prints it): every value quoted, the payload in
    run.root reaching srun's log paths and the job folder as whole arguments; the engine's
    arguments travel pickled, and the comment that shows them splits back into them."""
    assert cli.main(["submit", "--dry-run"], {**HOSTILE_ENV, "GPUS": "0"}) == 0
    script = capsys.readouterr().out
    done = run_bash(script, tmp_path)
    assert done.returncode == 0, done.stderr
    (srun,) = calls(tmp_path / "log")
    (line,) = [x for x in script.splitlines() if x.startswith("srun ")]
    assert srun == shlex.split(line) and srun[-1] == f"/runs/{PAYLOAD}/digits/shared/slurm"
    assert_no_payload_ran(srun, tmp_path)
    for name in ("PARTITION", "ACCOUNT", "QOS", "CONSTRAINT", "EXCLUDE"):
        key = name.lower()
        (directive,) = [x for x in script.splitlines() if x.startswith(f"#SBATCH --{key}=")]
        assert shlex.split(directive) == ["#SBATCH", f"--{key}={HOSTILE_ENV[name]}"]
    (task,) = [x for x in script.splitlines() if x.startswith("#   every task: ")]
    argv = shlex.split(task.removeprefix("#   every task: "))  # the frozen config, whole
    assert (
        argv[argv.index("--resolved") + 1]
        == f"/runs/{PAYLOAD}/digits/shared/request/"
        + (argv[argv.index("--resolved") + 1].rpartition("/")[2])
    )
    (asked,) = [x for x in script.splitlines() if ": resolved from " in x]
    assert f"log.project={PAYLOAD}" in shlex.split(asked.partition(": resolved from ")[2])


def test_hostile_values_stay_inert_in_the_local_command(tmp_path):
    """The local command starts the venv's python by its path: run it in a checkout whose
    engine only records how it was started."""
    checkout = helpers.fake_checkout(tmp_path / "checkout", FAKE_TRAIN, CONFIG)
    record = tmp_path / "record"
    checked = str(tmp_path / "checked")  # the dry run's check of the config, recorded apart
    printed = launch(
        "dry-run", cwd=checkout, GPUS="0", ARGS=HOSTILE_ENV["ARGS"], FAKE_RECORD=checked
    )
    assert printed.returncode == 0, printed.stderr
    line = one_line(printed.stdout)
    done = subprocess.run(
        ["bash", "-c", line],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "FAKE_RECORD": str(record), "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (started,) = [json.loads(x)["orig_argv"] for x in record.read_text().splitlines()]
    assert started == shlex.split(line) and f"log.project={PAYLOAD}" in started
    assert_no_payload_ran(started, tmp_path)


def test_a_config_name_with_the_payload_is_refused(capsys):
    assert cli.main(["train", "--dry-run"], {"CONFIG": PAYLOAD, "GPUS": "0"}) == 2
    out, err = capsys.readouterr()
    assert out == "" and "has no variant" in one_line(err)
