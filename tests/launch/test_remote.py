"""REMOTE=: what goes over ssh, without an ssh server. A stand-in for ssh hands its command
line to `sh -c` in a bare environment, as sshd hands it to the user's shell; a stand-in for the
remote python records what it was given. tests/slurm/test_remote_slurm.py runs the real thing
through sshd to the local cluster."""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import sys
from pathlib import Path

import pytest

from engine import codeid
from launch import remote, snapshot
from tests.helpers import REPO, launch

FAKE_SSH = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
while args[0].startswith("-"):  # options, each with its value, as REMOTE_SSH gives them
    args = args[2:] if args[0] in ("-o", "-i", "-p") else args[1:]
env = {{"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}}  # sshd passes nothing else
sys.exit(subprocess.run(["sh", "-c", " ".join(args[1:])], env=env).returncode)
"""
RECORDING_PYTHON = """#!{python}
import json, os, sys
with open("received.json", "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}, f)
print("the remote's own output"); print("and its stderr", file=sys.stderr)
sys.exit(7)
"""


def executable(path: Path, text: str) -> str:
    path.write_text(text.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def there(tmp_path: Path) -> dict[str, str]:
    """REMOTE_* for a remote folder in tmp_path, reached through the ssh stand-in."""
    folder = tmp_path / "login" / "recipes"
    return {
        "REMOTE": "me@login",
        "REMOTE_DIR": str(folder),
        "REMOTE_SSH": f"{executable(tmp_path / 'ssh', FAKE_SSH)} -o BatchMode=yes",
        "REMOTE_PYTHON": executable(tmp_path / "python", RECORDING_PYTHON),
    }


def with_code(there: dict[str, str]) -> Path:
    """The remote folder, holding code as an earlier copy left it (launch/ alone, here)."""
    folder = Path(there["REMOTE_DIR"])
    (folder / "launch").mkdir(parents=True)
    (folder / "launch" / "__main__.py").write_text("")
    return folder


def received(there: dict[str, str]) -> dict:
    return json.loads((Path(there["REMOTE_DIR"]) / "received.json").read_text())


def test_hostile_values_arrive_as_they_were_set_and_nothing_runs(there, tmp_path):
    with_code(there)
    marker = tmp_path / "pwned"
    hostile = {
        "ARGS": f'"; touch {marker}',
        "RECIPE": f"$(touch {marker})",
        "PARTITION": f"`touch {marker}`",
        "RUN": f"x' ; touch {marker} ; '",
        "SBATCH_HOLD": "1",
    }
    argv = ["status", "--", f"a'; touch {marker}; echo '"]
    done = launch(*argv, **there, **hostile, SECRET_TOKEN="s3cret")
    assert (done.returncode, done.stdout, done.stderr) == (
        7,
        "the remote's own output\n",
        "and its stderr\n",
    )  # the remote's output and status, unchanged
    got = received(there)
    assert got["argv"] == ["-m", "launch", *argv]
    assert got["cwd"] == there["REMOTE_DIR"]
    assert {k: got["env"][k] for k in hostile} == hostile
    assert got["env"]["REMOTE"] == ""  # the login node submits there, never onward
    assert "SECRET_TOKEN" not in got["env"] and not marker.exists()


def test_submit_copies_the_code_and_this_checkout_s_identity_then_submits_there(there):
    folder = Path(there["REMOTE_DIR"])
    (folder / "engine").mkdir(parents=True)
    (folder / "engine" / "deleted_here.py").write_text("stale\n")  # an earlier copy's
    (folder / codeid.RECORD).write_text("{}")
    (folder / "runs" / "digits" / "old").mkdir(parents=True)
    identity = codeid.identity(REPO)
    done = launch("submit", **there, GPUS="0", ARGS="train.max_steps=3")
    assert done.returncode == 7, done.stderr
    assert received(there)["argv"] == ["-m", "launch", "submit"]
    assert received(there)["env"]["ARGS"] == "train.max_steps=3"

    names = snapshot.files(REPO)
    assert f"copied {len(names)} files" in done.stderr
    assert all((folder / n).is_file() or (folder / n).is_symlink() for n in names)
    assert not (folder / "engine" / "deleted_here.py").exists()
    assert (folder / "runs" / "digits" / "old").is_dir()  # runs are never touched
    assert codeid.same_code(codeid.identity(folder), identity)
    # Without git there, the snapshot a submission takes is the copied code.
    copied = snapshot.files(folder)
    assert "engine/train.py" in copied and "launch/remote.py" in copied


def test_a_dry_run_prints_the_copy_and_the_ssh_command_then_the_remote_s_dry_run(there):
    folder = with_code(there)
    done = launch("submit", **there, DRY_RUN="1", GPUS="0", NODES="")
    first, command, remote_out = done.stdout.splitlines()
    assert f"would copy {len(snapshot.files(REPO))} files (" in first
    words = shlex.split(command)
    assert words[:4] == [*shlex.split(there["REMOTE_SSH"]), "me@login"]
    assert words[4].startswith(f"cd -- {folder} && env REMOTE= DRY_RUN=1 GPUS=0 ")
    assert remote_out == "the remote's own output" and done.returncode == 7
    assert received(there)["env"]["DRY_RUN"] == "1"
    assert "NODES" not in received(there)["env"]  # make exports the unset ones empty
    assert sorted(p.name for p in folder.rglob("*")) == ["__main__.py", "launch", "received.json"]


def test_an_unreachable_host_is_one_line_naming_it_and_ssh_s_error(tmp_path):
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client: apt-get install openssh-client")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path / "remote"
    done = launch(
        "submit",
        REMOTE=f"ssh://root@127.0.0.1:{port}",
        REMOTE_DIR=str(folder),
        REMOTE_SSH="ssh -o BatchMode=yes -o ConnectTimeout=5",
    )
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"launch: ssh ssh://root@127.0.0.1:{port} failed: ")
    assert "Connection refused" in line and "nothing was copied or queued" in line
    assert not folder.exists()


@pytest.mark.parametrize(
    ("env", "command", "says"),
    [
        ({"REMOTE_DIR": ""}, "submit", "needs REMOTE_DIR=<the folder on me@login"),
        ({"REMOTE": "-oProxyCommand=touch x"}, "status", "is not an ssh destination"),
        ({"REMOTE_SSH": "ssh -o 'unclosed"}, "status", "REMOTE_SSH cannot be split"),
        ({}, "train", "train runs on this machine, not over REMOTE=me@login"),
        ({}, "reproduce", "reproduce runs on this machine, not over REMOTE=me@login"),
        ({}, "sweep", "add TARGET=submit"),
        ({"REMOTE_PYTHON": "no/such/python"}, "status", "make venv"),
    ],
)
def test_a_bad_remote_request_is_one_line_and_runs_nothing(there, env, command, says):
    with_code(there)
    done = launch(command, **(there | env))
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("launch: ") and says in line, line
    assert not (Path(there["REMOTE_DIR"]) / "received.json").exists()


def test_a_folder_holding_files_of_its_own_is_refused_untouched(there):
    folder = Path(there["REMOTE_DIR"])
    (folder / "docs").mkdir(parents=True)  # a home directory, say
    (folder / "docs" / "notes.txt").write_text("mine\n")
    done = launch("submit", **there)
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and "holds files no earlier copy put there" in line, line
    assert sorted(p.name for p in folder.rglob("*")) == ["docs", "notes.txt"]
    (folder / "docs" / "notes.txt").unlink()
    (folder / "docs").rmdir()
    for kept in (".venv", "runs", "data"):  # what a folder may hold before its first copy
        (folder / kept).mkdir()
    assert launch("submit", **there).returncode == 7


def test_a_missing_folder_for_a_watch_command_is_one_line_and_made_by_no_one(there):
    done = launch("status", **there)
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and f"REMOTE_DIR={there['REMOTE_DIR']} is not a folder" in line
    assert not Path(there["REMOTE_DIR"]).exists()
    Path(there["REMOTE_DIR"]).mkdir(parents=True)  # a folder, but no copy of the code yet
    done = launch("status", **there, DRY_RUN="1")
    assert done.returncode == 2 and "no code in" in done.stderr and "make submit" in done.stderr


def test_commands_that_read_only_the_code_run_here():
    assert not remote.forwards(_args("recipes"), {"REMOTE": "me@login"})
    assert remote.forwards(_args("status"), {"REMOTE": "me@login"})
    assert not remote.forwards(_args("submit"), {"REMOTE": ""})


def _args(command: str):
    from launch.cli import parse_args

    return parse_args([command])
