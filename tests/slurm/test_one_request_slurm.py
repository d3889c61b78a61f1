"""One run name, one request, on the real cluster: a sweep whose CONFIG file changed after its
members were queued is not grown from the new file (its cells would pool two requests); the
refusal names the keys and leaves sweep.json as it was."""

from __future__ import annotations

import json

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
    done = helpers.launch("sweep", "--slurm", "--no-wait", SEEDS="2", timeout=180, **env)
    manifest = tmp_path / "digits" / "cfgmove-sweep" / "sweep.json"
    record = json.loads(manifest.read_text())
    slurm_cluster.submitted += [a["job"] for a in record["attempts"].values()]
    assert len(record["attempts"]) == 2, done.stderr  # both queued behind the blocker

    asked.write_text("recipe: digits\noptim:\n  lr: 0.4\ntrain:\n  epochs: 1\n")
    grown = helpers.launch("sweep", "--slurm", "--no-wait", SEEDS="3", timeout=180, **env)
    assert grown.returncode == 2, grown.stderr
    (line,) = grown.stderr.splitlines()
    assert line.startswith("launch: sweep cfgmove: member cfgmove-seed0 was trained or queued")
    assert "optim.lr 0.05 -> 0.4" in line and "train.epochs 2 -> 1" in line
    assert json.loads(manifest.read_text()) == record  # seeds: still 2, nothing submitted
    assert not (tmp_path / "digits" / "cfgmove-seed2").exists()
