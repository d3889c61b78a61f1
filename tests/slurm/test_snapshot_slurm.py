"""A job runs the code and the config it was submitted with (launch.snapshot): held in the
queue while the checkout changes and its CONFIG file is edited and deleted, released,
preempted and requeued, it trains and resumes from its snapshot and its frozen config, and
names that code in env.json and its checkpoints."""

from __future__ import annotations

import json
import re

from engine import codeid
from tests import helpers
from tests.helpers import git_checkout
from tests.slurm.test_launch_slurm import PREEMPTIBLE, preempt, stop_and_resume_steps

BROKEN = 'raise SystemExit("the checkout\'s code ran, not the snapshot")\n'


def test_a_held_job_runs_and_resumes_the_code_submitted_not_the_checkout_s(slurm_cluster, tmp_path):
    repo, root = git_checkout(tmp_path / "repo"), tmp_path / "runs"
    submitted_code = codeid.identity(repo)
    # Both nodes taken whole: the job submitted next waits in the queue behind this one (its
    # output outside the checkout: a new file there would change the code's identity).
    blocker = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--exclusive",
        f"--output={tmp_path}/blocker.out",
        "--wrap",
        "sleep 300",
    ).stdout.strip()
    slurm_cluster.submitted.append(blocker)
    assert slurm_cluster.wait_for_state(blocker, {"RUNNING"}) == "RUNNING"
    args = f"{PREEMPTIBLE} log.wandb=off run.root={root} run.name=held"
    asked = tmp_path / "asked.yaml"  # a CONFIG file outside the checkout, as in a login's /tmp
    asked.write_text("recipe: digits\noptim:\n  lr: 0.0123\n")
    done = helpers.launch("submit", cwd=repo, GPUS="0", ARGS=args, CONFIG=str(asked))
    assert done.returncode == 0, done.stderr
    job = re.search(r"submitted job (\d+)", done.stdout)[1]
    slurm_cluster.submitted.append(job)
    assert slurm_cluster.state(job) == "PENDING"
    # One name, one request: another request under the queued run's name is refused before
    # anything is queued (it would have trained in the run's place, or found it done).
    again = helpers.launch("submit", cwd=repo, GPUS="0", ARGS=f"{args} optim.lr=0.3")
    assert again.returncode == 2, again.stderr
    assert f"run.name=held has a job queued or running, {job} (PENDING)" in again.stderr
    assert "submitted job" not in again.stdout

    for module in ("engine/train.py", "launch/slurm.py"):  # the checkout moves on meanwhile
        path = repo / module
        path.write_text(BROKEN + path.read_text())
    asked.write_text("recipe: digits\noptim:\n  lr: 9.0\n")  # the request is edited...
    asked.unlink()  # ...then deleted, while the job waits
    assert slurm_cluster.run("scancel", blocker).returncode == 0

    run = root / "digits" / "held"
    log = run / "slurm" / f"{job}_0_log.err"
    preempt(slurm_cluster, job, log)
    result = slurm_cluster.wait(job, timeout=300)
    text = log.read_text()
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), text[-3000:]
    stopped, resumed = stop_and_resume_steps(text)  # the requeue resumed: the same code
    assert stopped == resumed
    assert "the checkout's code ran" not in text

    (snapshot,) = (run / "code").iterdir()
    recorded = json.loads((snapshot / codeid.RECORD).read_text())
    assert codeid.same_code(recorded, submitted_code) and recorded["dirty"] is False
    env = json.loads((run / "env.json").read_text())
    assert codeid.same_code(env["code"], submitted_code), env["code"]
    assert codeid.same_code(helpers.final_checkpoint(root, "held")["code"], submitted_code)
    assert not codeid.same_code(codeid.identity(repo), submitted_code)  # the checkout's differs

    # The request as submitted, to the last byte: the frozen file is the run's saved config.
    (frozen,) = (run / "request").iterdir()
    assert frozen.read_bytes() == (run / "config.yaml").read_bytes()
    assert "  lr: 0.0123\n" in frozen.read_text() and not frozen.stat().st_mode & 0o222
