"""The local two-node cluster behaves like the real clusters the launch layer targets:
multi-node steps, requeue, signal delivery, and submitit jobs."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

submitit = pytest.importorskip("submitit")


def test_two_node_job_runs_one_task_on_each_node(slurm_cluster, tmp_path):
    script = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --job-name=two-node
srun bash -c 'echo "task $SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME $SLURM_JOB_NODELIST \
$SLURM_NTASKS $(getent hosts $SLURMD_NODENAME | cut -d" " -f1)"'
"""
    job_id = slurm_cluster.submit(script, tmp_path)
    result = slurm_cluster.wait(job_id, timeout=60)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), output

    tasks = sorted(line.split()[1:] for line in output.splitlines() if line.startswith("task "))
    assert [t[0] for t in tasks] == ["0", "1"], output  # SLURM_PROCID
    assert [t[1] for t in tasks] == ["0", "1"], output  # SLURM_NODEID: one task per node
    assert [t[2] for t in tasks] == ["node1", "node2"], output  # SLURMD_NODENAME
    assert {t[3] for t in tasks} == {"node[1-2]"}, output  # SLURM_JOB_NODELIST
    assert {t[4] for t in tasks} == {"2"}, output  # SLURM_NTASKS
    # Node names resolve, so MASTER_ADDR=node1 works for torch.distributed.
    assert {t[5] for t in tasks} == {"127.0.0.1"}, output


def test_requeued_job_runs_again_with_incremented_restart_count(slurm_cluster, tmp_path):
    script = """#!/bin/bash
#SBATCH --job-name=requeue
echo "run ${SLURM_RESTART_COUNT:-0}" >> runs.txt
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then touch started; sleep 300; fi
"""
    job_id = slurm_cluster.submit(script, tmp_path)
    slurm_cluster.wait_for_file(tmp_path / "started")
    requeue = slurm_cluster.run("scontrol", "requeue", job_id)
    assert requeue.returncode == 0, requeue.stderr

    # The restart waits out the step credential lifetime (cred_expire=5 s in cluster.sh).
    result = slurm_cluster.wait(job_id, timeout=60)
    assert (result.state, result.exit_code) == ("COMPLETED", 0), result.info
    assert result.restarts == 1
    assert (tmp_path / "runs.txt").read_text().splitlines() == ["run 0", "run 1"]


def test_usr2_reaches_steps_batch_shell_and_its_children_as_requested(slurm_cluster, tmp_path):
    # A step (srun), the batch shell and a plain child of the batch shell each trap USR2
    # and record it. `scancel --signal` alone signals steps only, `--batch` the batch
    # shell only, `--full` the batch shell and all its children.
    script = """#!/bin/bash
#SBATCH --job-name=signals
trap 'echo batch >> batch.sig' USR2
bash -c 'trap "echo child >> child.sig; exit 0" USR2; touch child.ready
         while true; do sleep 0.1; done' &
srun --ntasks=1 bash -c 'trap "echo step >> step.sig; exit 0" USR2; touch step.ready
         while true; do sleep 0.1; done' &
until [ -e child.sig ] && [ -e step.sig ] && [ -e batch.sig ]; do sleep 0.1; done
wait
"""
    job_id = slurm_cluster.submit(script, tmp_path)
    wait_for_file = slurm_cluster.wait_for_file
    wait_for_file(tmp_path / "step.ready")
    wait_for_file(tmp_path / "child.ready")

    def signal(*flags):
        out = slurm_cluster.run("scancel", "--signal=USR2", *flags, job_id)
        assert out.returncode == 0, out.stderr

    signal()
    assert wait_for_file(tmp_path / "step.sig", 15, nonempty=True) == "step\n"
    time.sleep(1)
    assert not (tmp_path / "batch.sig").exists() and not (tmp_path / "child.sig").exists()

    signal("--batch")
    assert wait_for_file(tmp_path / "batch.sig", 15, nonempty=True) == "batch\n"
    time.sleep(1)
    assert not (tmp_path / "child.sig").exists()

    signal("--full")
    assert wait_for_file(tmp_path / "child.sig", 15, nonempty=True) == "child\n"
    result = slurm_cluster.wait(job_id, timeout=30)
    assert (result.state, result.exit_code) == ("COMPLETED", 0), result.info


# ---- submitit: the launch layer submits through it -------------------------------------


def _executor(tmp_path, **params):
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit" / "%j")
    assert executor.cluster == "slurm"
    executor.update_parameters(slurm_partition="debug", timeout_min=10, **params)
    return executor


def _wait_submitit(job, timeout: float = 60):
    """submitit cannot get states without sacct (they stay UNKNOWN); it sees results
    through its result files, so a job that dies without one would wait forever."""
    deadline = time.monotonic() + timeout
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"submitit job {job.job_id} gave no result within {timeout:.0f}s")
        time.sleep(0.25)


def test_submitit_two_node_function_job_returns_every_rank(slurm_cluster, tmp_path):
    def where(tag):
        import os
        import sys

        import submitit

        env = submitit.JobEnvironment()
        return {
            "tag": tag,
            "rank": env.global_rank,
            "local_rank": env.local_rank,
            "world_size": env.num_tasks,
            "num_nodes": env.num_nodes,
            "hostnames": env.hostnames,
            "node": os.environ["SLURMD_NODENAME"],
            "python": sys.executable,
        }

    job = _executor(tmp_path, nodes=2, tasks_per_node=1).submit(where, "hello")
    _wait_submitit(job)
    results = sorted(job.results(), key=lambda r: r["rank"])
    assert [(r["rank"], r["node"]) for r in results] == [(0, "node1"), (1, "node2")]
    for r in results:
        assert r["tag"] == "hello"
        assert (r["local_rank"], r["world_size"], r["num_nodes"]) == (0, 2, 2)
        assert r["hostnames"] == ["node1", "node2"]
        assert r["python"] == sys.executable  # the repo's venv, on every node
    assert socket.gethostbyname(results[0]["hostnames"][0]) == "127.0.0.1"


def test_submitit_reports_an_exception_raised_in_the_job(slurm_cluster, tmp_path):
    def fail():
        raise ValueError("boom from the job")

    job = _executor(tmp_path, nodes=1, tasks_per_node=1).submit(fail)
    _wait_submitit(job)
    with pytest.raises(submitit.core.utils.FailedJobError, match="boom from the job"):
        job.result()


def _wait_for_text(path, text, timeout=30):
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path} did not say {text!r} within {timeout}s"
        time.sleep(0.1)


def test_submitit_preempted_checkpointable_job_is_requeued_and_finishes(slurm_cluster, tmp_path):
    class Resumable(submitit.helpers.Checkpointable):
        def __call__(self, marker):
            import os
            import pathlib
            import time

            restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
            if restarts == 0:
                pathlib.Path(marker).touch()
                time.sleep(300)
            return restarts

    marker = tmp_path / "first-run"
    job = _executor(tmp_path, nodes=1, tasks_per_node=1).submit(Resumable(), str(marker))
    slurm_cluster.wait_for_file(marker)
    # Preemption as SLURM does it: SIGTERM, then USR2, to the job's steps (job._interrupt()).
    # Each scancel only asks slurmd, so the SIGTERM could arrive after the USR2 and kill the
    # `scontrol requeue` that submitit's USR2 handler runs: the USR2 goes once the job has
    # logged the SIGTERM (launch.slurm.requeue makes the engine's own requeue immune).
    subprocess.run(["scancel", "--signal", "TERM", job.job_id], check=True)
    _wait_for_text(job.paths.stderr, "Bypassing signal SIGTERM")
    subprocess.run(["scancel", "--signal", "USR2", job.job_id], check=True)
    _wait_submitit(job, timeout=60)
    assert job.result() == 1
    assert slurm_cluster.wait(job.job_id, timeout=30).restarts == 1
