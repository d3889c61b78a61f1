"""One run name, one request, on the real cluster: a sweep whose CONFIG file changed after its
members were queued is not grown from the new file (its cells would pool two requests); the
refusal names the keys and leaves sweep.json as it was. A member that failed in a setup line,
or that SLURM holds, is said as such, with what to do."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from tests import helpers

QUIET = "log.wandb=off log.progress=off"


def block_both_nodes(slurm_cluster, tmp_path) -> str:
    """A job that takes both nodes whole: what is submitted next waits in the queue."""
    blocker = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--exclusive", f"--output={tmp_path}/blocker.out",
        "--wrap", "sleep 300",
    ).stdout.strip()  # fmt: skip
    slurm_cluster.submitted.append(blocker)
    assert slurm_cluster.wait_for_state(blocker, {"RUNNING"}) == "RUNNING"
    return blocker


def test_a_sweep_grown_after_its_config_file_changed_is_refused_with_the_difference(
    slurm_cluster, tmp_path
):
    block_both_nodes(slurm_cluster, tmp_path)
    asked = tmp_path / "lr.yaml"
    asked.write_text("recipe: digits\noptim:\n  lr: 0.05\ntrain:\n  epochs: 2\n")
    args = f"{QUIET} run.root={tmp_path} run.name=cfgmove"
    env = {"GPUS": "0", "CONFIG": str(asked), "ARGS": args}
    done = helpers.launch("sweep", "--slurm", SEEDS="2", WAIT="0", timeout=180, **env)  # returns
    manifest = tmp_path / "digits" / "cfgmove-sweep" / "sweep.json"
    record = json.loads(manifest.read_text())
    slurm_cluster.submitted += [a["job"] for a in record["attempts"].values()]
    assert len(record["attempts"]) == 2, done.stderr  # both queued behind the blocker
    seed0 = record["attempts"]["cfgmove-seed0"]["job"]

    # Another request under a queued member's name: refused, naming the task (it would have
    # trained in the member's place, and the member found it "already finished").
    args0 = f"{QUIET} run.root={tmp_path} run.name=cfgmove-seed0 optim.lr=0.3"
    again = helpers.launch("submit", GPUS="0", CONFIG=str(asked), ARGS=args0, timeout=120)
    assert again.returncode == 2 and "submitted job" not in again.stdout, again.stderr
    assert f"run.name=cfgmove-seed0 has a job queued or running, {seed0} (PENDING)" in again.stderr
    # A name the sweep would grow into, held by another submission's live job: refused too.
    args2 = f"{QUIET} run.root={tmp_path} run.name=cfgmove-seed2 seed=2"
    other = helpers.launch("submit", GPUS="0", CONFIG=str(asked), ARGS=args2, timeout=120)
    assert other.returncode == 0, other.stderr
    slurm_cluster.submitted.append(job2 := re.search(r"submitted job (\d+)", other.stdout)[1])
    grown = helpers.launch("sweep", "--slurm", SEEDS="3", WAIT="0", timeout=180, **env)
    assert grown.returncode == 2, grown.stderr
    assert f"run.name=cfgmove-seed2 has a job queued or running, {job2} (PENDING)" in grown.stderr
    assert json.loads(manifest.read_text()) == record
    assert slurm_cluster.run("scancel", job2).returncode == 0
    slurm_cluster.wait(job2)

    asked.write_text("recipe: digits\noptim:\n  lr: 0.4\ntrain:\n  epochs: 1\n")
    grown = helpers.launch("sweep", "--slurm", "--no-wait", SEEDS="3", timeout=180, **env)
    assert grown.returncode == 2, grown.stderr
    (line,) = grown.stderr.splitlines()
    assert line.startswith("launch: sweep cfgmove: member cfgmove-seed0 was trained or queued")
    assert "optim.lr 0.05 -> 0.4" in line and "train.epochs 2 -> 1" in line
    assert json.loads(manifest.read_text()) == record  # seeds: still 2, nothing submitted


def test_a_member_that_failed_in_a_setup_line_is_failed_with_that_line(slurm_cluster, tmp_path):
    """Not `missing` with a rerun that fails again: the report, its last line and make
    status say which setup line failed where."""
    asked = tmp_path / "site.yaml"
    asked.write_text("recipe: digits\nslurm:\n  setup: ['false']\n")
    args = f"{QUIET} run.root={tmp_path} run.name=badsetup train.max_steps=2"
    done = helpers.launch("sweep", "--slurm", SEEDS="1", GPUS="0", CONFIG=str(asked), ARGS=args,
                          timeout=240)  # fmt: skip
    manifest = json.loads((tmp_path / "digits" / "badsetup-sweep" / "sweep.json").read_text())
    slurm_cluster.submitted += [a["job"] for a in manifest["attempts"].values()]
    assert done.returncode == 1, done.stderr
    line = "error: setup line 1 failed on node1 (exit 1): false"
    assert done.stderr.splitlines()[-1] == (
        f"launch: sweep badsetup: 0 of 1 members finished (1 failed); badsetup-seed0: {line}; "
        "fix that, then rerun the same command to run the rest"
    )
    member = tmp_path / "digits" / "badsetup-seed0"
    row = helpers.launch("status", RUNS=str(member)).stdout.strip().splitlines()[1]
    assert row.split()[1] == "failed" and row.endswith(line), row


def test_a_held_task_is_said_with_its_release_and_the_waiting_sweep_ends(slurm_cluster, tmp_path):
    """A task SLURM holds (after a requeue that failed to launch, or by hand) never starts by
    itself: the waiting sweep ends on it with the command that releases it, and make status
    and a rerun say so instead of `requeued` and "nothing to run"."""
    block_both_nodes(slurm_cluster, tmp_path)
    args = f"{QUIET} run.root={tmp_path} run.name=hold train.max_steps=2"
    env = helpers.launch_env(GPUS="0", SEEDS="1", ARGS=args)
    sweep = subprocess.Popen([sys.executable, "-m", "launch", "sweep", "--slurm"], cwd=helpers.REPO,
                             env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        manifest = tmp_path / "digits" / "hold-sweep" / "sweep.json"
        deadline = time.monotonic() + 120
        while '"job"' not in (manifest.read_text() if manifest.exists() else ""):
            assert time.monotonic() < deadline and sweep.poll() is None, sweep.stderr
            time.sleep(0.2)
        (job,) = [a["job"] for a in json.loads(manifest.read_text())["attempts"].values()]
        slurm_cluster.submitted.append(job)
        assert slurm_cluster.run("scontrol", "hold", job).returncode == 0
        _, err = sweep.communicate(timeout=120)  # ends by itself
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert f"member hold-seed0 (job {job}) is held: scontrol release {job} starts it again" in err
    row = helpers.launch("status", RUNS=str(tmp_path / "digits" / "hold-seed0")).stdout
    assert f"held (JobHeldAdmin: scontrol release {job})" in row, row
    again = helpers.launch("sweep", "--slurm", "--no-wait", timeout=120, **env)
    assert f"(1 held); hold-seed0: held: scontrol release {job}; fix that" in again.stderr


def test_a_sweep_slurm_refuses_leaves_no_record_of_it(slurm_cluster, tmp_path):
    """A launch that queued nothing leaves the sweep as it was: here, no sweep at all."""
    args = f"{QUIET} run.root={tmp_path} run.name=nopart train.max_steps=2"
    done = helpers.launch("sweep", "--slurm", "--no-wait", SEEDS="1", GPUS="0", ARGS=args,
                          PARTITION="no-such-partition", timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "SLURM refused the job: " in done.stderr and "nothing was queued" in done.stderr
    assert not (tmp_path / "digits" / "nopart-sweep").exists()
