"""`python -m launch submit|sweep|render` on the local cluster, with the real engine and the
digits recipe: a 2-node job that records both hosts and passes the digits bar; a preemption
(SIGUSR2) mid-training that requeues the job and resumes it bit for bit in the same W&B run;
the rendered sbatch script, checked by `sbatch --test-only` and run by hand through a
preemption; a grid sweep as one job array with a concurrency limit, and its report."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests import helpers
from tests.helpers import final_weights, read_wandb_history, same_weights

ROOT = Path(__file__).resolve().parents[2]
DIGITS_BAR = 0.98  # top1 the digits recipe reaches with its own config (15 epochs)
# Preemption runs: 110 steps (22 per epoch), one log line per step, so that the signal sent
# once step 30 is logged stops training mid-epoch, well before its end.
PREEMPTIBLE = "train.epochs=5 ckpt.every_steps=0 log.every_steps=1"
STOPPED = re.compile(r"stopped at step (\d+) \(preempted: SIGUSR2\)")
RESUMED = re.compile(r"resuming from \S+/step-(\d+)\.pt \(epoch \d+, step (\d+)\)")


def launch(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return helpers.launch(*args, timeout=timeout, **{"GPUS": "0", "WANDB_MODE": "offline", **env})


def submit(slurm_cluster, args: str, **env: str) -> tuple[str, str]:
    """`python -m launch submit` with ARGS=args; returns (job id, its stdout)."""
    done = launch("submit", ARGS=args, **env)
    assert done.returncode == 0, done.stderr
    match = re.search(r"submitted job (\d+)", done.stdout)
    assert match, done.stdout
    slurm_cluster.submitted.append(match.group(1))
    return match.group(1), done.stdout


def wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        if time.monotonic() > deadline:
            tail = path.read_text()[-2000:] if path.exists() else "(no log)"
            raise TimeoutError(f"{text!r} not in {path} after {timeout:.0f}s:\n{tail}")
        time.sleep(0.05)


def preempt(slurm_cluster, job: str, log: Path) -> None:
    """SIGUSR2 to the job's tasks once its log shows training under way (epoch 1)."""
    wait_for_text(log, "step 30/", timeout=180)
    out = slurm_cluster.run("scancel", "--signal=USR2", job)
    assert out.returncode == 0, out.stderr


def stop_and_resume_steps(text: str) -> tuple[int, int]:
    """The step the preempted attempt saved at and the step the next attempt resumed from
    (both from the log, the latter also from the checkpoint file's name)."""
    stopped, resumed = STOPPED.findall(text), RESUMED.findall(text)
    assert len(stopped) == 1 and len(resumed) == 1, text[-3000:]
    file_step, step = resumed[0]
    assert int(file_step) == int(step), text[-3000:]
    return int(stopped[0]), int(step)


def printed_script(*args: str, **env: str) -> str:
    """The batch script part of a dry run (the task commands follow it as comments)."""
    done = launch(*args, DRY_RUN="1", **env)
    assert done.returncode == 0, done.stderr
    script, marker, _ = done.stdout.partition("# Each task unpickles its job and runs:")
    assert marker, done.stdout
    return script


def test_submit_on_two_nodes_records_both_hosts_and_passes_the_digits_bar(slurm_cluster, tmp_path):
    root = tmp_path / "runs"  # the recipe's own config: 15 epochs
    args = f"run.name=two run.root={root}"
    dry = printed_script("submit", ARGS=args, NODES="2")
    assert not root.exists()
    job, out = submit(slurm_cluster, args, NODES="2")
    run = root / "digits" / "two"
    assert f"run dir: {run}" in out and "2 node(s) x 1 task(s), CPU" in out
    assert (run / "slurm" / f"{job}_submission.sh").read_text() == dry  # what the dry run showed

    result = slurm_cluster.wait(job, timeout=400)
    log = (run / "slurm" / f"{job}_0_log.err").read_text()
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 0), log[-3000:]
    assert result.info["NodeList"] == "node[1-2]"
    env = json.loads((run / "env.json").read_text())
    assert env["world_size"] == 2 and env["slurm_job_id"] == job
    assert env["hosts"] == ["node1", "node2"], env["hosts"]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["epochs"]) == (2, 15), summary
    assert summary["top1"] >= DIGITS_BAR, summary


def test_submit_preempted_mid_training_resumes_bitwise_in_the_same_wandb_run(
    slurm_cluster, tmp_path
):
    root = tmp_path / "runs"
    config = f"{PREEMPTIBLE} log.wandb=offline run.root={root}"
    job, _ = submit(slurm_cluster, f"{config} run.name=pre")
    reference, _ = submit(slurm_cluster, f"{config} run.name=ref")  # same config, no signal
    run = root / "digits" / "pre"
    log = run / "slurm" / f"{job}_0_log.err"
    preempt(slurm_cluster, job, log)
    wandb_id = (run / "wandb-id.txt").read_text().strip()  # written before the first step
    assert re.fullmatch(r"[0-9a-z]+", wandb_id), wandb_id

    result = slurm_cluster.wait(job, timeout=300)
    text = log.read_text()
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), text[-3000:]
    stopped, resumed = stop_and_resume_steps(text)
    assert stopped == resumed
    assert f"requeued job {job}" in text
    assert "Caught signal" not in text  # the engine's handler ran, not submitit's
    # The requeue is a record with its cause: metrics.jsonl, state.json, the report.
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (requeue,) = [e for e in events if e["kind"] == "requeue"]
    assert requeue == {"kind": "requeue", "step": stopped, "restart": 1, "job": job,
                       "cause": "preempted: SIGUSR2", "checkpoint": f"step-{stopped:08d}.pt"}  # fmt: skip
    assert json.loads((run / "state.json").read_text())["requeues"] == 1
    done = launch("report", str(run))
    report = (run.parent / "report-pre.md").read_text()
    assert done.returncode == 0 and "## SLURM requeues" in report, done.stderr
    assert f"| pre | 1 | {job} | {stopped} | preempted: SIGUSR2 |" in report

    ref = slurm_cluster.wait(reference, timeout=300)
    assert (ref.state, ref.exit_code, ref.restarts) == ("COMPLETED", 0, 0)
    summaries = [
        json.loads((root / "digits" / n / "summary.json").read_text()) for n in ("pre", "ref")
    ]
    assert stopped < summaries[1]["steps"], "the signal arrived after training had ended"
    for s in summaries:
        del s["seconds"]
    assert summaries[0] == summaries[1]
    assert same_weights(final_weights(root, "pre"), final_weights(root, "ref"))

    assert (run / "wandb-id.txt").read_text().strip() == wandb_id
    attempts = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(attempts) == 2, attempts
    assert [read_wandb_history(p)[0] for p in attempts] == [wandb_id, wandb_id]


@pytest.mark.parametrize(
    ("request_vars", "nodes"),
    [({"NODES": "2"}, r"node\[1-2\]"), ({"PROCS": "2"}, r"node[12]")],
    ids=["2-nodes", "2-procs"],
)
def test_rendered_sbatch_script_passes_sbatch_test_only(
    slurm_cluster, tmp_path, request_vars, nodes
):
    name = f"t{tmp_path.name}"
    args = f"run.name={name} run.root={tmp_path}/runs"
    done = launch("render", "--target", "sbatch", ARGS=args, **request_vars)
    assert done.returncode == 0, done.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(done.stdout)

    out = slurm_cluster.run("sbatch", "--test-only", str(script))
    assert out.returncode == 0, out.stderr
    match = re.search(
        r"sbatch: Job (\d+) to start at \S+ using 2 processors on nodes (\S+) in partition",
        out.stderr,
    )
    assert match and re.fullmatch(nodes, match[2]), out.stderr
    # nothing was queued: no job with that id, none with the script's job name
    assert slurm_cluster.run("scontrol", "show", "job", match[1]).returncode != 0
    listed = slurm_cluster.run("squeue", "-h", "--states=all", "-n", f"digits-{name}", "-o", "%i")
    assert listed.returncode == 0 and listed.stdout.strip() == "", listed.stdout


def test_rendered_sbatch_script_requeues_on_75_and_resumes(slurm_cluster, tmp_path):
    args = f"{PREEMPTIBLE} run.name=hand run.root={tmp_path}/runs"
    done = launch("sbatch", ARGS=args)  # make sbatch: the code and the config frozen
    assert done.returncode == 0, done.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(done.stdout)
    run = tmp_path / "runs" / "digits" / "hand"
    (run / "slurm").mkdir(parents=True)
    out = slurm_cluster.run("sbatch", "--parsable", str(script))
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    slurm_cluster.submitted.append(job)
    log = run / "slurm" / f"{job}.err"
    preempt(slurm_cluster, job, log)

    result = slurm_cluster.wait(job, timeout=300)
    text = log.read_text()
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), text[-3000:]
    stopped, resumed = stop_and_resume_steps(text)
    assert stopped == resumed
    assert f"requeueing job {job}" in text
    summary = json.loads((run / "summary.json").read_text())
    assert stopped < summary["steps"]


def test_a_grid_sweep_is_one_job_array_with_its_concurrency_limit(slurm_cluster, tmp_path):
    # One axis of two values and two seeds: 4 array tasks, 2 at once (the grid's naming of
    # several axes is tests/launch/test_sweep.py's, and the same code plans a SLURM sweep).
    grid = "optim.lr=0.1,0.05"
    args = f"{grid} train.epochs=1 run.name=sw run.root={tmp_path}/runs"
    env = {"SEEDS": "2", "PARALLEL": "2", "ARGS": args}
    dry = printed_script("sweep", "--slurm", **env)
    assert "#SBATCH --array=0-3%2\n" in dry  # 2 cells x 2 seeds, 2 tasks at once
    done = launch("sweep", "--slurm", timeout=600, **env)
    tasks = re.findall(r"submitted (\d+)_(\d+): (\S+)", done.stdout)
    slurm_cluster.submitted += [f"{array}_{i}" for array, i, _ in tasks]
    assert done.returncode == 0, done.stdout + done.stderr
    assert len({array for array, _, _ in tasks}) == 1, done.stdout  # one job array
    array = tasks[0][0]
    parent = tmp_path / "runs" / "digits"
    written = parent / "sw-sweep" / "slurm" / f"{array}_submission.sh"
    assert written.read_text() == dry
    cells = ["lr0.1", "lr0.05"]
    members = [f"sw-{c}-seed{s}" for s in range(2) for c in cells]
    assert [(int(i), name) for _, i, name in tasks] == list(enumerate(members))

    config = yaml.safe_load((parent / members[3] / "config.yaml").read_text())
    assert (config["seed"], config["optim"]["lr"]) == (1, 0.05)
    data = json.loads((parent / "sw-sweep" / "report.json").read_text())
    by_name = {c["name"]: c for c in data["cells"]}
    assert data["grid"]["axes"] == {"optim.lr": ["0.1", "0.05"]}
    assert data["parallel"] == 2 and data["command"]["env"]["PARALLEL"] == "2"
    for cell in cells:
        top1 = [
            json.loads((parent / f"sw-{cell}-seed{s}" / "summary.json").read_text())["top1"]
            for s in range(2)
        ]
        stats = by_name[cell]["top1"]
        assert by_name[cell]["counts"] == {"finished": 2}
        assert stats["mean"] == pytest.approx(statistics.fmean(top1), abs=1e-12)
        assert stats["std"] == pytest.approx(statistics.stdev(top1), abs=1e-12)
    assert (parent / "sw-sweep" / "report.md").read_text() in done.stdout

    again = launch("sweep", "--slurm", timeout=120, **env)  # every member finished
    assert again.returncode == 0 and "submitted" not in again.stdout, again.stderr
    assert "4 of 4 members finished or queued; 0 to run" in again.stderr


def refused(root: Path, **env: str) -> str:
    """`python -m launch submit` that SLURM refuses: its one line; nothing queued or kept."""
    name = f"refused-{os.getpid()}"
    args = f"run.name={name} run.root={root} train.max_steps=2"
    done = launch("submit", ARGS=args, timeout=120, **env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stdout == "", done.stderr
    assert not root.exists()  # nor the folders made for it
    assert jobs_named(name) == ""  # submitit names the job after the run
    return done.stderr


def jobs_named(name: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "--states=all", "-n", name, "-o", "%i"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()


def test_an_unreachable_controller_is_one_line_and_leaves_nothing(slurm_cluster, tmp_path):
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).read_text()
    wrong_port = re.sub(r"(?m)^SlurmctldPort=\d+", "SlurmctldPort=1", conf)
    assert wrong_port != conf
    # sbatch gives up on the controller at once, not after its retries (9 s each, ~30 s)
    wrong_port = "MessageTimeout=1\n" + re.sub(r"(?m)^MessageTimeout=.*\n", "", wrong_port)
    (tmp_path / "slurm.conf").write_text(wrong_port)
    line = refused(tmp_path / "runs", SLURM_CONF=str(tmp_path / "slurm.conf"))
    assert "Unable to contact slurm controller" in line
    assert "is slurmctld running and reachable from here?" in line


def test_an_unknown_partition_is_one_line_and_leaves_nothing(slurm_cluster, tmp_path):
    line = refused(tmp_path / "runs", PARTITION="no-such-partition")
    assert line.startswith("launch: SLURM refused the job: ")
    assert "Invalid partition name specified; check PARTITION" in line


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"NODES": "3"}, "NODES=3 but partition debug has 2 node(s); ask for at most 2"),
        ({"GPUS": "1"}, "GPUS=1 but partition debug has no GPUs (no node lists a gpu GRES"),
        ({"CPUS_PER_TASK": "3"}, "need 3 CPUs on a node, but the largest node of partition debug has 2"),
        ({"MEM_GB": "1000"}, "MEM_GB=1000 but the largest node of partition debug has 4096 MB"),
        ({"NODES": "1:3", "PARTITION": "debug"}, "NODES=3 but partition debug has 2 node(s)"),
    ],
    ids=["nodes", "gpus", "cpus", "memory", "node range"],
)  # fmt: skip
def test_a_request_larger_than_the_partition_is_refused_with_its_limits(
    slurm_cluster, tmp_path, env, said
):
    """It would wait in the queue for ever (or be refused as if slurmctld were down)."""
    name = f"big-{os.getpid()}"
    args = f"run.name={name} run.root={tmp_path} train.max_steps=2"
    done = launch("submit", ARGS=args, timeout=60, **env)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert said in line and line.endswith("nothing was queued"), line
    assert not (tmp_path / "digits" / name).exists() and jobs_named(name) == ""


def test_a_failing_setup_line_fails_the_job_and_make_status_names_it(slurm_cluster, tmp_path):
    """slurm.setup runs as `set -e` would, on every node of the job before any rank starts:
    a line that fails on the second node only (a module or a disk missing there) ends the
    job FAILED before training, and make status names the line and the node, not a job
    that "finished" nor the wrapper's report."""
    asked = tmp_path / "site.yaml"
    line = 'test "$SLURMD_NODENAME" != node2'
    asked.write_text(f"recipe: digits\nslurm:\n  setup: ['true', '{line}']\n")
    args = f"run.root={tmp_path} run.name=nosetup"
    job, _ = submit(slurm_cluster, args, CONFIG=str(asked), NODES="2", GPUS="0")
    assert slurm_cluster.wait(job, timeout=120).state == "FAILED"
    run = tmp_path / "digits" / "nosetup"
    status = launch("status", RUNS=str(run))
    row = re.split(r"\s{2,}", status.stdout.strip().splitlines()[1])
    assert row[1:3] == ["failed", job], status.stdout
    assert row[-1] == f"error: setup line 2 failed on node2 (exit 1): {line}", status.stdout
    assert not (run / "config.yaml").exists()  # the engine never started
    # Once SLURM forgets the job (MinJobAge; here: no SLURM command to ask), the run folder
    # alone still says failed and why, not "prepared" for its frozen request.
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "squeue").exists())  # fmt: skip
    later = launch("status", RUNS=str(run), PATH=path)
    row = re.split(r"\s{2,}", later.stdout.strip().splitlines()[1])
    assert row[1:3] == ["failed", job] and row[-1].startswith("error: setup line 2"), later.stdout
