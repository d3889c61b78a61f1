"""`python -m launch submit|sweep` and the rendered sbatch script on the local cluster, with
the real engine and the digits recipe: a 2-node job, preemption (SIGUSR2) ending in a requeue
that resumes from the checkpoint, and a seed sweep as a job array with its report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUEST_VARS = {"RECIPE", "GPUS", "NODES", "PROCS", "ARGS", "DRY_RUN", "SEEDS", "TARGET"}


def launch(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in REQUEST_VARS}
    full.update(GPUS="0", WANDB_MODE="offline", **env)
    return subprocess.run(
        [sys.executable, "-m", "launch", *args],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submitted_job(out: str) -> str:
    match = re.search(r"submitted job (\d+)", out)
    assert match, out
    return match.group(1)


def wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        if time.monotonic() > deadline:
            tail = path.read_text()[-2000:] if path.exists() else "(no log)"
            raise TimeoutError(f"{text!r} not in {path} after {timeout:.0f}s:\n{tail}")
        time.sleep(0.5)


def test_submit_runs_one_rank_per_task_across_two_nodes(slurm_cluster, tmp_path):
    args = f"train.epochs=1 run.name=two run.root={tmp_path}/runs"
    done = launch("submit", NODES="2", ARGS=args)
    assert done.returncode == 0, done.stderr
    job = submitted_job(done.stdout)
    slurm_cluster.submitted.append(job)
    run = tmp_path / "runs" / "digits" / "two"
    assert f"run dir: {run}" in done.stdout

    result = slurm_cluster.wait(job, timeout=300)
    log = (run / "slurm" / f"{job}_0_log.err").read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), log[-3000:]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


def test_submit_preempted_job_requeues_and_resumes(slurm_cluster, tmp_path):
    args = f"train.epochs=6 run.name=pre run.root={tmp_path}/runs"
    done = launch("submit", ARGS=args)
    assert done.returncode == 0, done.stderr
    job = submitted_job(done.stdout)
    slurm_cluster.submitted.append(job)
    run = tmp_path / "runs" / "digits" / "pre"
    log = run / "slurm" / f"{job}_0_log.err"
    wait_for_text(log, "step 30/", timeout=180)
    assert slurm_cluster.run("scancel", "--signal=USR2", job).returncode == 0

    result = slurm_cluster.wait(job, timeout=300)
    text = log.read_text()
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), text[-3000:]
    stopped = re.search(r"stopped at step (\d+) \(preempted\)", text)
    resumed = re.search(r"resuming from \S+ \(epoch \d+, step (\d+)\)", text)
    assert stopped and resumed and stopped.group(1) == resumed.group(1), text[-3000:]
    assert f"requeued job {job}" in text
    assert "Caught signal" not in text  # the engine's handler ran, not submitit's
    assert (run / "summary.json").is_file()


def test_rendered_sbatch_script_requeues_on_75_and_resumes(slurm_cluster, tmp_path):
    args = f"train.epochs=6 run.name=hand run.root={tmp_path}/runs"
    done = launch("render", "--target", "sbatch", ARGS=args)
    assert done.returncode == 0, done.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(done.stdout)
    logs = tmp_path / "runs" / "digits" / "hand" / "slurm"
    logs.mkdir(parents=True)
    out = slurm_cluster.run("sbatch", "--parsable", str(script))
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    slurm_cluster.submitted.append(job)
    wait_for_text(logs / f"{job}.err", "step 30/", timeout=180)
    assert slurm_cluster.run("scancel", "--signal=USR2", job).returncode == 0

    result = slurm_cluster.wait(job, timeout=300)
    text = (logs / f"{job}.err").read_text()
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), text[-3000:]
    assert f"requeueing job {job}" in text and "resuming from" in text
    assert (tmp_path / "runs" / "digits" / "hand" / "summary.json").is_file()


def test_sweep_as_a_job_array_writes_the_report(slurm_cluster, tmp_path):
    args = f"train.epochs=1 run.name=sw run.root={tmp_path}/runs"
    done = launch("sweep", "--slurm", "--seeds", "2", ARGS=args, timeout=400)
    slurm_cluster.submitted += re.findall(r"submitted (\d+_\d+):", done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    report = tmp_path / "runs" / "digits" / "sw-sweep"
    data = json.loads((report / "report.json").read_text())
    assert data["seeds"] == [0, 1]
    assert [data["runs"][s]["run"] for s in ("0", "1")] == ["sw-seed0", "sw-seed1"]
    assert 0 < data["metrics"]["top1"]["mean"] <= 1 and data["metrics"]["top1"]["n"] == 2
    assert (report / "report.md").read_text() in done.stdout
