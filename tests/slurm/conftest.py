"""Tests against the real local SLURM cluster (bash tests/slurm/cluster.sh start).

Every test in this folder is marked `slurm` and needs the cluster: without it the test is
skipped, which tests/conftest.py turns into a failure under CI=true. The `slurm_cluster`
fixture also submits batch scripts and waits for jobs. sacct does not work here (no
slurmdbd), so final states and exit codes come from `scontrol show job`, which keeps a
finished job for MinJobAge (600 s) after its end.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NODES = ("node1", "node2")
UP_STATES = {"idle", "mixed", "allocated", "completing"}
FINAL_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}
NOT_RUNNING = "local SLURM cluster is not running: bash tests/slurm/cluster.sh start"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slurm)


def _run(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def node_states() -> dict[str, str]:
    """{'node1': 'idle', ...} as sinfo reports it; empty when SLURM does not answer."""
    try:
        out = _run("sinfo", "-h", "-N", "-o", "%N %T", timeout=15)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    return dict(line.split(maxsplit=1) for line in out.stdout.splitlines() if " " in line)


def job_info(job_id: str) -> dict[str, str] | None:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...); None if unknown."""
    out = _run("scontrol", "show", "job", "-o", str(job_id))
    if out.returncode != 0 or "JobState=" not in out.stdout:
        return None
    return dict(re.findall(r"(\S+?)=(\S*)", out.stdout.strip()))


@dataclass
class JobResult:
    job_id: str
    state: str
    exit_code: int
    signal: int
    restarts: int
    info: dict[str, str]


@dataclass
class SlurmCluster:
    """Submits batch scripts to the local cluster and waits for them."""

    submitted: list[str] = field(default_factory=list)

    def submit(self, script: str, workdir: Path, *sbatch_args: str) -> str:
        """Writes `script` to workdir/job.sh and submits it there; output in slurm-%j.out."""
        path = Path(workdir) / "job.sh"
        path.write_text(script)
        out = _run(
            "sbatch", "--parsable", f"--chdir={workdir}", *sbatch_args, str(path), timeout=30
        )
        assert out.returncode == 0, f"sbatch failed: {out.stderr.strip()}"
        job_id = out.stdout.strip().split(";")[0]
        self.submitted.append(job_id)
        return job_id

    def state(self, job_id: str) -> str | None:
        info = job_info(job_id)
        return info["JobState"] if info else None

    def wait_for_state(self, job_id: str, states: set[str], timeout: float = 60) -> str:
        """Polls until the job is in one of `states` (or has ended); returns that state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if state in states or state in FINAL_STATES:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f}s")
            time.sleep(0.2)

    def wait(self, job_id: str, timeout: float = 60) -> JobResult:
        """Waits until the job has ended (squeue no longer lists it as pending, running or
        completing) and returns its final state and exit code from scontrol."""
        deadline = time.monotonic() + timeout
        while True:
            info = job_info(job_id)
            queued = _run("squeue", "-h", "-j", str(job_id), "-o", "%T").stdout.strip()
            if info is None and not queued:
                raise LookupError(f"job {job_id} unknown to slurmctld")
            if info and info["JobState"] in FINAL_STATES and not queued:
                code, _, sig = info.get("ExitCode", "0:0").partition(":")
                return JobResult(
                    job_id,
                    info["JobState"],
                    int(code),
                    int(sig or 0),
                    int(info.get("Restarts", "0")),
                    info,
                )
            if time.monotonic() > deadline:
                state = info["JobState"] if info else queued
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f}s")
            time.sleep(0.25)

    def cancel(self, *job_ids: str) -> None:
        if job_ids:
            _run("scancel", *job_ids)

    @staticmethod
    def run(*cmd: str) -> subprocess.CompletedProcess:
        """Runs a SLURM command (scontrol, scancel, ...) and captures its output."""
        return _run(*cmd)

    @staticmethod
    def wait_for_file(path: Path, timeout: float = 30, nonempty: bool = False) -> str:
        """Waits until `path` exists (and, if `nonempty`, has content); returns its text."""
        deadline = time.monotonic() + timeout
        while not (path.exists() and (not nonempty or path.stat().st_size > 0)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {timeout:.0f}s")
            time.sleep(0.1)
        return path.read_text()


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    states = node_states()
    if not all(states.get(node) in UP_STATES for node in NODES):
        pytest.skip(f"{NOT_RUNNING} (sinfo: {states or 'no answer'})")
    return SlurmCluster()


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs(slurm_cluster):
    """Every test here needs the cluster; jobs a test submitted are cancelled after it."""
    already = len(slurm_cluster.submitted)
    yield
    slurm_cluster.cancel(*slurm_cluster.submitted[already:])
