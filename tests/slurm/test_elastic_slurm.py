"""An elastic node range under SLURM: `NODES=1:2 python -m launch submit` starts on both idle
nodes; node2 is drained and the job requeued, so it starts again on node1 alone, resumes
from its newest checkpoint at world size 1 and finishes there, training the very samples of
an uninterrupted one-process run, step for step."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import final_weights, max_difference, records, run_dir, run_engine

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 40
# GroupNorm: no batch statistics, so how a step's 64 samples are split over processes does
# not matter: 2 processes x 2 micro batches of 16, then 1 process x 4.
RUN = (
    f"model.norm=group train.max_steps={STEPS} train.micro_batch_size=16 log.sample_ids=true "
    "ckpt.every_steps=5 log.every_steps=1"
)
# Only the SLURM run: each micro batch 60 ms late, so that training is still under way (about
# 0.15 s a step on two nodes) when the test acts on its step-10 checkpoint.
SLOW = "fault.data_delay_ms=60 log.wandb=off"
DRAIN_AFTER = 10  # the step whose checkpoint must exist before node2 goes
DRAIN = "reason=elastic-test"
# tests/distributed/test_distributed.py's bound for a resume at another world size: the batch
# is summed in another order after it; the drift through SGD momentum stays below this.
RESUME_TOLERANCE = 5e-5


def launch(*args: str, timeout: float = 60, **env: str):
    return helpers.launch(*args, timeout=timeout, **{"GPUS": "0", "WANDB_MODE": "offline", **env})


def job_logs(run: Path, job: str) -> str:
    """The tail of each task's stderr (every attempt's: the job's files are appended to)."""
    files = sorted((run / "slurm").glob(f"{job}_*_log.err")) if job else []
    tails = [f"--- {p.name}\n{p.read_text()[-3000:]}" for p in files]
    return "\n".join(tails) or f"(no log of job {job or '?'} under {run / 'slurm'})"


def wait_until(what: str, done, timeout: float, context) -> None:
    """Polls done() until it holds; past the deadline, fails with context() (logs, states)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s\n{context()}")
        time.sleep(0.1)


def newest_checkpoint(run: Path) -> int:
    steps = [int(p.stem.removeprefix("step-")) for p in (run / "checkpoints").glob("step-*.pt")]
    return max(steps, default=0)


def sample_ids(root: Path, name: str) -> list[dict]:
    lines = (run_dir(root, name) / "samples.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def node_states(slurm_cluster) -> dict[str, str]:
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
    return dict(line.split(maxsplit=1) for line in out.splitlines() if " " in line)


def test_a_job_whose_second_node_is_drained_finishes_on_one_with_the_same_samples(
    slurm_cluster, tmp_path
):
    root = tmp_path / "runs"
    name = f"elastic-{tmp_path.name}"
    run = run_dir(root, name)
    job = ""

    def logs() -> str:
        return job_logs(run, job)

    def states() -> str:
        return f"sinfo: {node_states(slurm_cluster)}"

    def idle(*nodes: str) -> bool:
        return all(node_states(slurm_cluster).get(n) == "idle" for n in nodes)

    # Another test's job may still hold a node, and the range takes what is free at the start.
    wait_until("node1 and node2 idle", lambda: idle("node1", "node2"), 120, states)
    done = launch("submit", NODES="1:2", ARGS=f"{RUN} {SLOW} run.name={name} run.root={root}")
    # Every job of the run's name (submitit names the job after the run), even one queued by a
    # submission that failed after sbatch: the conftest's fixture cancels them after the test.
    queued = slurm_cluster.run("squeue", "-h", "--states=all", "-n", name, "-o", "%i").stdout
    slurm_cluster.submitted += queued.split()
    match = re.search(r"submitted job (\d+)", done.stdout)
    job = match[1] if match else next(iter(queued.split()), "")
    assert done.returncode == 0 and match, f"{done.stdout}\n{done.stderr}\n{logs()}"
    assert "1-2 node(s) x 1 task(s), CPU" in done.stdout, done.stdout

    drained = False
    try:
        assert slurm_cluster.wait_for_state(job, {"RUNNING"}, timeout=60) == "RUNNING", logs()
        wait_until(
            f"a checkpoint at step {DRAIN_AFTER} or later",
            lambda: (run / "checkpoints").is_dir() and newest_checkpoint(run) >= DRAIN_AFTER,
            120,
            logs,
        )
        first = json.loads((run / "env.json").read_text())  # the first attempt's
        assert (first["world_size"], first["hosts"]) == (2, ["node1", "node2"]), (first, logs())
        assert slurm_cluster.state(job) == "RUNNING", logs()  # not done yet: 40 steps
        drained = True
        out = slurm_cluster.run("scontrol", "update", "nodename=node2", "state=drain", DRAIN)
        assert out.returncode == 0, f"drain: {out.stderr}"
        out = slurm_cluster.run("scontrol", "requeue", job)  # no hold or release needed
        assert out.returncode == 0, f"requeue: {out.stderr}\n{logs()}"

        # The uninterrupted one-process run, while SLURM holds the requeued job back a while.
        run_engine(root, "ref", *RUN.split())
        result = slurm_cluster.wait(job, timeout=240)
    finally:  # the other tests need both nodes
        slurm_cluster.cancel(job)
        if drained:
            out = slurm_cluster.run("scontrol", "update", "nodename=node2", "state=resume")
            assert out.returncode == 0, f"node2 left drained: {out.stderr}"

    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), logs()
    assert result.info["NodeList"] == "node1", (result.info["NodeList"], logs())
    changes = records(root, name, "world_size")
    assert len(changes) == 1, (changes, logs())
    change, step = changes[0], changes[0]["step"]
    # The newest checkpoint: a periodic one, or the one the engine saves on the SIGTERM that
    # the requeue sends (then no step is trained again).
    assert DRAIN_AFTER <= step < STEPS and change["checkpoint"] == f"step-{step:08d}.pt", change
    shape = {k: change[k] for k in ("from", "to", "accum_steps", "micro_batch")}
    assert shape == {"from": 2, "to": 1, "accum_steps": 4, "micro_batch": 16}, change
    assert change["redone_steps"] >= 0 and change["lost_s"] >= 0, change
    log = (run / "slurm" / f"{job}_0_log.err").read_text()
    assert f"world size 2 -> 1: resumed from step-{step:08d}.pt (step {step})" in log, logs()
    env = json.loads((run / "env.json").read_text())
    assert (env["world_size"], env["hosts"], env["slurm_job_id"]) == (1, ["node1"], job), env
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (1, STEPS), summary

    ids = sample_ids(root, name)
    assert [line["step"] for line in ids] == list(range(STEPS)), logs()
    assert ids == sample_ids(root, "ref")
    drift = max_difference(final_weights(root, name), final_weights(root, "ref"))
    assert drift < RESUME_TOLERANCE, drift
    wait_until("node2 idle again", lambda: idle("node2"), 60, states)
