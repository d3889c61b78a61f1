"""Checks made before anything starts or is queued.

The engine validates a request's config for its world size (batch sizes that divide over the
processes, precision the device supports, a run directory that may be claimed, W&B's mode)
in a subprocess, `python -m engine.train ... --check N`: launch imports no torch, and the same
code then runs in every worker. A mistake is one line here, with nothing started, instead of
a traceback from each worker under torchrun or a job that fails after its wait in the queue.
"""

from __future__ import annotations

import json
import subprocess
from types import ModuleType

from launch import render
from launch.errors import UserError
from launch.render import LaunchRequest
from launch.request import ROOT

CHECK_TIMEOUT_S = 600  # importing torch on a slow shared filesystem can take minutes


def check_argv(req: LaunchRequest, data_here: bool, resolved: bool = False) -> list[str]:
    """The engine's check; data_here: this machine runs it, so its data must be here too
    (otherwise a data location this machine cannot see may be the compute nodes'); resolved:
    it prints the config it checked (--print-config), which a submission freezes."""
    sizes = ",".join(map(str, req.world_sizes))  # an elastic range: every size it may take
    check = ["--check", sizes, *(["--data-here"] if data_here else [])]
    check += ["--print-config"] if resolved else []
    return [req.python, "-m", "engine.train", *render.engine_args(req), *check]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1].removeprefix("error: ") if lines else ""


def run_check(argv: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the engine's check, in a process of its own."""
    try:
        done = subprocess.run(
            argv, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise UserError(f"could not check the config with {argv[0]}: {err}", code=1) from None
    return done.returncode, done.stdout, done.stderr


def engine_check(req: LaunchRequest, data_here: bool = False, resolved: bool = False) -> str:
    """The request's config resolved and checked by the engine for each world size the run
    may take, and its data where this machine can see it; resolved: returns that config's
    text (what the run saves as config.yaml)."""
    code, stdout, stderr = run_check(check_argv(req, data_here, resolved))
    if code == 0:
        return stdout if resolved else ""
    said = last_line(stderr) or f"exit code {code}"
    sizes = " or ".join(", ".join(map(str, req.world_sizes)).rsplit(", ", 1))  # 1, 2 or 3
    where = f"for {sizes} process(es)" if req.world_sizes != [1] else "for one process"
    raise UserError(f"{said} (config checked {where}; nothing was started)", code=2)


def resolved_configs(reqs: list[LaunchRequest]) -> list[str]:
    """Each request's resolved config (what --print-config prints), in one engine process:
    a sweep's members frozen without a torch start-up each (engine.resolved)."""
    if not reqs:
        return []
    argvs = [render.engine_args(r) for r in reqs]
    argv = [reqs[0].python, "-m", "engine.resolved"]
    code, stdout, stderr = run_check(argv, stdin=json.dumps(argvs))
    if code != 0:
        said = last_line(stderr) or f"exit code {code}"
        raise UserError(f"{said} (a member's config, resolved; nothing was queued)", code=2)
    return json.loads(stdout)


def request_changes(pairs: list[tuple[LaunchRequest, str]]) -> list[list[str]]:
    """For each (request, saved request file): the differences that make the request another
    one than the file's, in one engine process (engine.resolved --compare)."""
    if not pairs:
        return []
    given = [[render.engine_args(r), saved] for r, saved in pairs]
    argv = [pairs[0][0].python, "-m", "engine.resolved", "--compare"]
    code, stdout, stderr = run_check(argv, stdin=json.dumps(given))
    if code != 0:
        said = last_line(stderr) or f"exit code {code}"
        raise UserError(f"{said} (a member's config, resolved; nothing was started)", code=2)
    return json.loads(stdout)


def slurm_support() -> ModuleType:
    """launch.slurm, whose submitit is needed only to submit or to print a submission."""
    try:
        from launch import slurm  # optional: a login node may lack submitit
    except ImportError as err:
        raise UserError(
            f"{err.name or 'submitit'} is not installed here: pip install submitit, or use the "
            "project's venv (make venv installs it); `make sbatch` prints a hand-written batch "
            "script that needs no Python to submit"
        ) from None
    return slurm
