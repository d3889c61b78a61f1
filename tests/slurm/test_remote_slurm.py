"""REMOTE=root@127.0.0.1: a submission from "another machine" through a real sshd on the
loopback address, to a folder that holds no git checkout, onto the local cluster. The job runs
from the login folder's own snapshot of the copied code, which carries this checkout's
identity, and `make status` over the same ssh shows it."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from engine import codeid
from engine.spawn import free_port
from tests.helpers import REPO, launch, launch_env

SSHD = Path("/usr/sbin/sshd")
STAMP = ".venv/.installed-lock"  # the Makefile's venv stamp; -o: never rebuild it from here


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """An sshd of the test's own on 127.0.0.1 (own host key, one authorized key, root by key
    only); yields the REMOTE_SSH that reaches it, stopped at the end."""
    if not SSHD.exists():
        pytest.skip("no sshd: apt-get install -y openssh-server")
    home = tmp_path_factory.mktemp("sshd")
    key, port = keygen(home / "key"), free_port()
    shutil.copy(home / "key.pub", home / "authorized_keys")
    (home / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nHostKey {keygen(home / 'host')}\n"
        f"AuthorizedKeysFile {home / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation folder
    server = subprocess.Popen(
        [str(SSHD), "-D", "-f", str(home / "sshd_config"), "-p", str(port), "-E", str(home / "log")]
    )
    deadline = time.monotonic() + 10
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert server.poll() is None and time.monotonic() < deadline, (home / "log").read_text()
        time.sleep(0.05)
    options = "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    yield f"ssh -o BatchMode=yes -i {key} {options} -p {port}"
    server.terminate()
    server.wait(timeout=10)


def test_a_submission_over_ssh_runs_the_copied_code_and_make_status_shows_it(
    slurm_cluster, sshd, tmp_path
):
    folder = tmp_path / "login"
    folder.mkdir()
    (folder / ".venv").symlink_to(REPO / ".venv")  # what `make venv` there would make
    there = {"REMOTE": "root@127.0.0.1", "REMOTE_DIR": str(folder), "REMOTE_SSH": sshd}
    identity = codeid.identity(REPO)
    args = "train.max_steps=4 log.wandb=off run.root=runs run.name=far"
    done = launch("submit", GPUS="0", ARGS=args, timeout=120, **there)
    assert done.returncode == 0, done.stderr
    job = re.search(r"submitted job (\d+)", done.stdout)[1]
    slurm_cluster.submitted.append(job)
    result = slurm_cluster.wait(job, timeout=120)

    run = folder / "runs" / "digits" / "far"  # run.root=runs: relative to REMOTE_DIR
    err = (run / "slurm" / f"{job}_0_log.err").read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), err[-3000:]
    env = json.loads((run / "env.json").read_text())
    assert codeid.same_code(env["code"], identity), (env["code"], identity)
    (snapshot,) = (run / "code").iterdir()  # the login folder's own snapshot of the copy
    assert codeid.same_code(json.loads((snapshot / codeid.RECORD).read_text()), identity)
    copied = (snapshot / "launch" / "remote.py").read_bytes()
    assert copied == (REPO / "launch" / "remote.py").read_bytes()

    status = subprocess.run(
        ["make", "-s", "-o", STAMP, "status"],
        cwd=REPO,
        env=launch_env() | there | {"RECIPE": "digits"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    (row,) = [line for line in status.stdout.splitlines() if "runs/digits/far" in line]
    assert re.search(rf"runs/digits/far\s+finished\s+{job}\b", row), status.stdout


def test_a_key_the_login_node_refuses_is_one_line_and_nothing_is_copied(sshd, tmp_path):
    stranger = keygen(tmp_path / "stranger")
    refused = re.sub(r"-i \S+", f"-i {stranger}", sshd)
    folder = tmp_path / "login"
    done = launch(
        "submit", REMOTE="root@127.0.0.1", REMOTE_DIR=str(folder), REMOTE_SSH=refused, GPUS="0"
    )
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("launch: ssh root@127.0.0.1 failed: ") and "Permission denied" in line
    assert not folder.exists()
