"""`REMOTE=user@login REMOTE_DIR=recipes make submit`: submit from another machine, over ssh.

REMOTE_DIR is a working folder on the login node (relative paths: from the home directory
there), where runs/ live and where `make venv` made the .venv that REMOTE_PYTHON names.
submit, sweep (TARGET=submit) and sbatch first copy this checkout's code there: the files a
snapshot takes (launch.snapshot.files: tracked and untracked-not-ignored, never data, runs
or venvs) and CODE.json holding this checkout's code identity, which engine.codeid reads
there, streamed as one tar over ssh after the previous copy's code folders are removed.
Then the same launch command runs there with the request variables set here, each value
quoted: the login node renders and submits exactly as it would for a user logged in, from a
snapshot of the copied code. Other commands (report, compare, the watch commands) run there
without a copy; the ones that train or build on this machine are refused. ssh's failures and
a missing directory or python are one line each (exit 2), before anything is queued."""

from __future__ import annotations

import argparse
import io
import json
import shlex
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

from engine import codeid
from launch import render, request, snapshot
from launch.errors import UserError

DEFAULT_SSH = "ssh -o BatchMode=yes"
DEFAULT_PYTHON = ".venv/bin/python"
# What launch reads from the environment (cli.py's docstring), and the watch commands' RUN,
# FOLLOW and JOB: forwarded when set here. SBATCH_* are sbatch's own input variables.
FORWARDED = (
    *"RECIPE CONFIG GPUS NODES PROCS ARGS IMAGE SIF DRY_RUN SEEDS TARGET RDZV_ENDPOINT".split(),
    *"RECIPES_DATA RECIPES_DIR RUNS SWEEP BASELINE PARALLEL ALLOW_CPU MAX_RESTARTS".split(),
    *"CKPT EMA OUT BEST FORCE AVERAGE RUN FOLLOW JOB".split(),
    *(var for _, var in request.SLURM_FLAGS.values()),
    *"WANDB_PROJECT WANDB_ENTITY WANDB_RUN_GROUP WANDB_MODE".split(),
)
FORWARDED_PREFIXES = ("SBATCH_",)
COPIES_CODE = ("submit", "sweep", "sbatch")
# They train or build on this machine: refused with REMOTE rather than run here by surprise.
RUNS_HERE = ("train", "eval", "dry-run", "docker-train", "image", "sif", "reproduce")
# They only read the code, the same here as there: they run here.
READS_CODE = ("render", "config", "recipes")
# The remote script's own exit codes for what it found wrong (ssh's own is 255).
NO_DIR, NO_PYTHON, A_CHECKOUT, COPY_FAILED, NO_CODE, NOT_OURS = 3, 4, 5, 6, 7, 8
# What a folder may hold before its first copy: the copy removes its code folders (docs/,
# tests/, ...), so a folder holding anything else (a home directory) is refused.
BEFORE_A_COPY = "[.]venv|runs|data"


@dataclass(frozen=True)
class Remote:
    dest: str  # user@host or ssh://user@host:port, as ssh takes it
    folder: str  # REMOTE_DIR, relative to the home directory there unless absolute
    python: str
    ssh: tuple[str, ...]

    def argv(self, script: str) -> list[str]:
        return [*self.ssh, self.dest, script]

    def where(self) -> str:
        return f"{self.folder} on {self.dest}"


def forwards(args: argparse.Namespace, env: Mapping[str, str]) -> bool:
    """Whether this command goes to REMOTE instead of running here."""
    return bool(env.get("REMOTE")) and args.command not in READS_CODE


def main(args: argparse.Namespace, argv: list[str], env: Mapping[str, str]) -> int:
    check_command(args, env)
    remote = target(env)
    dry = request.is_dry(args, env)
    names = snapshot.files(request.ROOT) if args.command in COPIES_CODE else []
    script = launch_script(remote, argv, env)
    if dry:
        print(dry_summary(remote, names))
        print(render.shell_join(remote.argv(script)), flush=True)
        prepare(remote, [])
    else:
        prepare(remote, names)
    return subprocess.run(remote.argv(script)).returncode


def check_command(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    if args.command in RUNS_HERE:
        raise UserError(
            f"{args.command} runs on this machine, not over REMOTE={env['REMOTE']}; submit it "
            "(make submit), or unset REMOTE to run it here"
        )
    if args.command == "sweep" and args.report is None:
        if not args.slurm and request.Asked.of(args, env).target_or_local()[1] != "submit":
            raise UserError(
                "a sweep over REMOTE is one SLURM job array there: add TARGET=submit "
                "(a local sweep would train on the login node)"
            )


def target(env: Mapping[str, str]) -> Remote:
    """REMOTE, REMOTE_DIR, REMOTE_PYTHON and REMOTE_SSH, checked."""
    dest = env["REMOTE"]
    if dest.startswith("-") or any(c.isspace() or not c.isprintable() for c in dest):
        raise UserError(f"REMOTE={dest!r} is not an ssh destination: give user@host")
    folder = env.get("REMOTE_DIR", "")
    if not folder.strip():
        raise UserError(
            f"REMOTE={dest} needs REMOTE_DIR=<the folder on {dest} for the code and its runs/>, "
            "e.g. REMOTE_DIR=recipes (relative to your home there)"
        )
    if not folder.isprintable():
        raise UserError(f"REMOTE_DIR={folder!r} cannot hold control characters or line breaks")
    folder = "." if folder == "~" else folder.removeprefix("~/")  # ssh starts in the home
    try:
        ssh = tuple(shlex.split(env.get("REMOTE_SSH") or DEFAULT_SSH))
    except ValueError as e:
        raise UserError(f"REMOTE_SSH cannot be split into words: {e}") from None
    if not ssh:
        raise UserError(f"REMOTE_SSH is empty; leave it unset for {DEFAULT_SSH!r}")
    return Remote(dest, folder, env.get("REMOTE_PYTHON") or DEFAULT_PYTHON, ssh)


def forwarded(env: Mapping[str, str]) -> dict[str, str]:
    """The request variables set here (make exports the unset ones empty), to be set there."""
    picked = (k for k in env if k in FORWARDED or k.startswith(FORWARDED_PREFIXES))
    return {k: env[k] for k in picked if env[k]}


def launch_script(remote: Remote, argv: list[str], env: Mapping[str, str]) -> str:
    """The remote shell line: `cd DIR && env NAME=value ... PYTHON -m launch ARGV`, every
    word quoted (ssh hands its command to the remote user's shell as one line)."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(forwarded(env).items())]
    # REMOTE= there: a login node whose environment names a REMOTE submits there, not onward.
    words = ["env", "REMOTE=", *assignments, shlex.quote(remote.python), "-m", "launch"]
    return f"cd -- {shlex.quote(remote.folder)} && {' '.join(words)} {shlex.join(argv)}"


def prepare(remote: Remote, names: list[str]) -> None:
    """One ssh call that checks the folder and the python there, first copying the code into
    it when names are given; its failures are one line each."""
    data = code_tar(names) if names else None
    done = subprocess.run(
        remote.argv(prepare_script(remote, names)), input=data, capture_output=True
    )
    if done.returncode != 0:
        raise UserError(failure(remote, done.returncode, done.stderr.decode(errors="replace")))
    if names:
        print(
            f"launch: copied {len(names)} files ({megabytes(names)}) of {describe()} to "
            f"{remote.where()}",
            file=sys.stderr,
            flush=True,
        )


def prepare_script(remote: Remote, names: list[str]) -> str:
    """cd into the folder (made first for a copy), unpack the code from stdin into it, check
    the python there; each failure exits with its own code."""
    folder, python = shlex.quote(remote.folder), shlex.quote(remote.python)
    found = f"test -x {python}" if "/" in remote.python else f"command -v {python} >/dev/null"
    if not names:
        steps = [
            f"cd -- {folder} || exit {NO_DIR}",
            f"test -f launch/__main__.py || exit {NO_CODE}",
        ]
        return "; ".join([*steps, f"{found} || exit {NO_PYTHON}"])
    tops = sorted({n.split("/")[0] for n in names if "/" in n} | set(snapshot.CODE_PATHS))
    others = f"\"$(ls -A | grep -vxE '{BEFORE_A_COPY}')\""
    steps = [
        f"mkdir -p -- {folder} && cd -- {folder} || exit {NO_DIR}",
        f"test ! -e .git || exit {A_CHECKOUT}",
        f"test -e {codeid.RECORD} || test -z {others} || exit {NOT_OURS}",
        f"rm -rf -- {shlex.join(tops)} && tar --no-same-owner -xzf - || exit {COPY_FAILED}",
        f"{found} || exit {NO_PYTHON}",
    ]
    return "; ".join(steps)


def failure(remote: Remote, code: int, stderr: str) -> str:
    said = (stderr.strip().splitlines() or ["no message"])[-1]
    if code == 255:
        return (
            f"ssh {remote.dest} failed: {said} (check REMOTE and REMOTE_SSH; try "
            f"ssh {remote.dest} true); nothing was copied or queued"
        )
    if code == NO_DIR:
        return (
            f"REMOTE_DIR={remote.folder} is not a folder on {remote.dest} ({said}); a submission "
            "without DRY_RUN makes it and copies the code there"
        )
    if code == NO_CODE:
        return (
            f"no code in {remote.where()} yet: a submission without DRY_RUN (make submit "
            "REMOTE=...) copies it there"
        )
    if code == NO_PYTHON:
        fix = shlex.quote(f"cd {shlex.quote(remote.folder)} && make venv")
        return (
            f"no {remote.python} in {remote.where()}: make it there once, ssh {remote.dest} "
            f"{fix} (make submit copies the Makefile and the lock there), or set REMOTE_PYTHON"
        )
    if code == A_CHECKOUT:
        return (
            f"REMOTE_DIR={remote.folder} on {remote.dest} is a git checkout; the copy would "
            "overwrite its files: give a folder of its own"
        )
    if code == NOT_OURS:
        return (
            f"REMOTE_DIR={remote.folder} on {remote.dest} holds files no earlier copy put there "
            f"(it has no {codeid.RECORD}), and the copy replaces its code folders: give a new "
            "folder (or one holding only .venv, runs/ and data/)"
        )
    return f"copying the code to {remote.where()} failed (exit {code}): {said}"


def code_tar(names: list[str]) -> bytes:
    """The files and CODE.json (this checkout's identity), as a gzipped tar."""
    src = request.ROOT
    snapshot.check_size(src, names)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in names:
            tar.add(src / name, arcname=name, recursive=False)
        record = json.dumps(identity_record(), indent=2).encode() + b"\n"
        info = tarfile.TarInfo(codeid.RECORD)
        info.size, info.mtime, info.mode = len(record), int(time.time()), 0o644
        tar.addfile(info, io.BytesIO(record))
    return buffer.getvalue()


def identity_record() -> dict:
    where = f"{socket.gethostname()}:{request.ROOT}"
    return codeid.identity(request.ROOT) | {"copied_from": where}


def megabytes(names: list[str]) -> str:
    return f"{sum((request.ROOT / n).lstat().st_size for n in names) / 2**20:.1f} MB"


def describe() -> str:
    return codeid.describe(codeid.identity(request.ROOT))


def dry_summary(remote: Remote, names: list[str]) -> str:
    if not names:
        return f"would run over ssh in {remote.where()} (no code copied for this command):"
    return (
        f"would copy {len(names)} files ({megabytes(names)}) of {describe()} and CODE.json to "
        f"{remote.where()}, then run there (the dry run below renders with the copy it "
        f"holds now):"
    )
