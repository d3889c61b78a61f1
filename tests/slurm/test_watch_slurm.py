"""`make status`, `make logs`, `make cancel` on the local cluster, with jobs submitted by
`python -m launch submit` (submitit) and the real engine: one job held in the queue, one on
both nodes kept running until it is cancelled, one that finishes on node2 and one that fails.
They are submitted once, together, and every test here reads them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import rundir
from tests import helpers

ROOT = Path(__file__).resolve().parents[2]
STAMP = ".venv/.installed-lock"  # the Makefile's venv stamp; -o: never rebuild it from here
QUIET = "log.wandb=off log.progress=plain"
# Slow enough to be caught running (a 20 ms wait per batch), stopped long before its end.
LONG = "train.max_steps=5000 log.every_steps=2 ckpt.every_steps=0 fault.data_delay_ms=20"
JOBS = {  # run name: (ARGS, request variables)
    "long": (LONG, {"NODES": "2"}),  # one CPU of each node
    "done": ("train.max_steps=4 log.every_steps=2", {"EXCLUDE": "node1"}),
    "broken": ("train.max_steps=40 log.every_steps=1 fault.raise_at_step=3", {}),
}
# Every CPU of both nodes: it waits behind `long`, and `scontrol uhold` (a user hold) keeps
# it waiting.
HELD = ("train.max_steps=4", {"NODES": "2", "CPUS_PER_TASK": "2"})


def launch_env(**extra: str) -> dict[str, str]:
    return helpers.launch_env(helpers.engine_env(), **extra)


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "-o", STAMP, *args], cwd=ROOT, env=launch_env(), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    return helpers.launch(*args, timeout=60, **env)


def rows(out: str) -> dict[str, list[str]]:
    """status's table by run name: [state, job, nodes, step, eval, last line]."""
    lines = out.strip().splitlines()
    assert lines and lines[0].startswith("RUN "), out
    return {Path(c[0]).name: c[1:] for c in (re.split(r"\s{2,}", line) for line in lines[1:])}


def wait_for_text(path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{text!r} not in {path} within {timeout:.0f}s"
        time.sleep(0.1)


def submit(slurm_cluster, root: Path, jobs: dict) -> dict[str, tuple[Path, str]]:
    """{run name: (run dir, job id)}, submitted together."""
    started = {}
    for name, (args, extra) in jobs.items():
        env = launch_env(GPUS="0", ARGS=f"{QUIET} run.root={root} run.name={name} {args}", **extra)
        started[name] = subprocess.Popen(
            [sys.executable, "-m", "launch", "submit"], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    found = {}
    for name, proc in started.items():
        out, err = proc.communicate(timeout=180)
        match = re.search(r"submitted job (\d+)", out)
        assert proc.returncode == 0 and match, err[-2000:]
        slurm_cluster.submitted.append(match.group(1))
        found[name] = (helpers.run_dir(root, name), match.group(1))
    return found


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """{run name: (run dir, job id)}, submitted at once (each submission checks its config
    with the engine first: seconds of imports)."""
    root = tmp_path_factory.mktemp("runs")
    found = submit(slurm_cluster, root, JOBS)
    assert slurm_cluster.wait_for_state(found["long"][1], {"RUNNING"}) == "RUNNING"
    found |= submit(slurm_cluster, root, {"held": HELD})
    hold = slurm_cluster.run("scontrol", "uhold", found["held"][1])
    assert hold.returncode == 0, hold.stderr
    yield found
    slurm_cluster.cancel(*(job for _, job in found.values()))


def test_status_tells_a_queued_a_running_a_finished_and_a_failed_job(jobs, slurm_cluster):
    assert slurm_cluster.wait(jobs["done"][1], timeout=120).state == "COMPLETED"
    assert slurm_cluster.wait(jobs["broken"][1], timeout=120).state == "FAILED"
    long_run, long_job = jobs["long"]
    wait_for_text(long_run / "slurm" / f"{long_job}_0_log.err", "step 4/5000")
    assert slurm_cluster.state(jobs["held"][1]) == "PENDING"

    done = make("status", f"RUNS={jobs['long'][0].parent}/*")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    found = rows(done.stdout)
    held_job = jobs["held"][1]  # waits for a person: said with the command that starts it
    assert found["held"][:4] == [
        f"held (JobHeldUser: scontrol release {held_job})",
        held_job,
        "-",
        "0",
    ]
    state, job, nodes, step, _, last = found["long"]
    assert (state, job, nodes) == ("running", long_job, "node[1-2]")
    assert int(step.split("/")[0]) >= 4 and step.endswith("/5000"), step
    # the running job's newest line is one of its log's own lines (a step's, an evaluation's
    # or a warning's, whichever came last: the test lost that race twice), clipped
    logged = "".join(p.read_text() for p in (long_run / "slurm").glob(f"{long_job}_*_log.*"))
    assert last and last.removesuffix("...") in logged, last
    assert not last.startswith(("srun: ", "slurmstepd: ")), last
    summary = json.loads((jobs["done"][0] / "summary.json").read_text())
    top1 = f"top1 {100 * summary['top1']:.2f}%"
    assert found["done"][:5] == ["finished", jobs["done"][1], "node2", "4/4", top1]
    assert found["broken"][:4] == ["failed (exit 1)", jobs["broken"][1], found["broken"][2], "3/40"]


def test_logs_show_the_last_lines_of_a_job_on_node2_and_every_node_of_a_job(jobs, slurm_cluster):
    run, job = jobs["done"]
    assert slurm_cluster.wait(job, timeout=120).info["NodeList"] == "node2"
    out = make("logs", f"RUN={run}")
    assert out.returncode == 0, out.stderr
    assert f"==> {run}/slurm/{job}_0_log.err <==" in out.stdout
    assert re.search(r"^digits: top1 \S+ .* 4 steps; run dir ", out.stdout, re.M), out.stdout
    run, job = jobs["long"]
    wait_for_text(run / "slurm" / f"{job}_1_log.out", "global_rank=1(2)")
    out = launch("logs", RUN=str(run))
    assert f"==> {run}/slurm/{job}_1_log.out <==" in out.stdout  # task 1: on node2
    assert "node=1(2), global_rank=1(2)" in out.stdout, out.stdout


def test_cancel_stops_a_running_job_with_a_checkpoint_and_a_queued_one(jobs, slurm_cluster):
    run, job = jobs["long"]
    wait_for_text(run / "slurm" / f"{job}_0_log.err", "step 4/5000")
    follower = subprocess.Popen(
        [sys.executable, "-m", "launch", "logs"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=launch_env(RUN=str(run), FOLLOW="1"),
    )  # fmt: skip
    try:
        done = make("cancel", f"RUN={run}")
        assert done.returncode == 0 and f"asked SLURM job {job} to stop" in done.stdout, done
        result = slurm_cluster.wait(job, timeout=120)
        out, err = follower.communicate(timeout=60)  # ends by itself with the job
    finally:
        if follower.poll() is None:
            follower.kill()
    assert (result.exit_code, result.restarts) == (75, 0), result  # ended, not requeued
    assert follower.returncode == 0, err
    assert re.search(r"stopped at step \d+ \(preempted: SIGTERM\); checkpoint saved", out), out
    end = json.loads((run / rundir.STATE_NAME).read_text())
    assert (end["state"], end["exit_code"]) == ("stopped", 75), end
    assert (run / "checkpoints" / f"step-{end['step']:08d}.pt").is_file()

    held, held_job = jobs["held"]
    done = launch("cancel", RUN=str(held))
    assert done.stdout == f"cancelled SLURM job {held_job} (held); make status says stopped\n"
    assert slurm_cluster.wait(held_job, timeout=60).state == "CANCELLED"
    found = rows(launch("status", RUNS=f"{run} {held}").stdout)
    assert found["long"][:4] == ["stopped", job, "node[1-2]", f"{end['step']}/5000"]
    assert found["held"][:2] == ["stopped", held_job]
    again = launch("cancel", RUN=str(run))
    assert (again.returncode, again.stderr) == (
        2, f"launch: {run} is not running (stopped); nothing to stop\n",
    )  # fmt: skip


def test_cancel_of_a_job_whose_engine_has_not_started_cancels_it_outright(slurm_cluster, tmp_path):
    """Before the engine holds its run, submitit's handler would ignore a TERM: the job is
    cancelled instead (nothing trained in it yet). A job that never reaches the engine
    stands in for one that is still starting."""
    run = tmp_path / "digits" / "starting"
    (run / "slurm").mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: digits\n")
    out = f"--output={run}/slurm/%j_0_log.out"
    job = slurm_cluster.submit("#!/bin/bash\necho starting\nsleep 120\n", run, out)
    assert slurm_cluster.wait_for_state(job, {"RUNNING"}) == "RUNNING"
    wait_for_text(run / "slurm" / f"{job}_0_log.out", "starting")
    found = rows(launch("status", RUNS=str(run)).stdout)
    node = slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
    assert found["starting"] == ["running", job, node, "0", "-", "starting"]
    done = launch("cancel", RUN=str(run))
    assert done.stdout == f"cancelled SLURM job {job} (running); make status says stopped\n"
    assert slurm_cluster.wait(job, timeout=60).state == "CANCELLED"
    assert rows(launch("status", RUNS=str(run)).stdout)["starting"][:2] == ["stopped", job]


def test_a_sweep_member_is_listed_watched_and_cancelled_alone_and_the_waiting_sweep_ends(
    slurm_cluster, tmp_path
):
    """A job array of three members, one task at a time: while the first runs, the two
    queued members are listed under their own <array>_<task>; cancelling the queued third
    and the running first stops just those (the second still runs and finishes), and the
    sweep that waits for its array ends with a line for each stopped member: no sacct, no
    wait for ever on a task that left no result."""
    args = f"{QUIET} train.max_steps=3000,6,7 {LONG.split(maxsplit=1)[1]} run.root={tmp_path}"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "launch", "sweep", "--slurm"], cwd=ROOT, text=True,
        env=launch_env(GPUS="0", SEEDS="1", PARALLEL="1", ARGS=f"{args} run.name=one"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        manifest = tmp_path / "digits" / "one-sweep" / "sweep.json"
        wait_for_text(manifest, '"job"', timeout=180)
        jobs = {n: a["job"] for n, a in json.loads(manifest.read_text())["attempts"].items()}
        slurm_cluster.submitted += list(jobs.values())
        (first, second, third) = sorted(jobs, key=lambda n: jobs[n])
        array = jobs[first].split("_")[0]
        assert [jobs[n] for n in (first, second, third)] == [f"{array}_{i}" for i in range(3)]
        wait_for_text(tmp_path / "digits" / first / rundir.LOG_NAME, "step 4/3000")

        found = rows(launch("status", RUNS=f"{tmp_path}/digits/one-*").stdout)
        assert sorted(found) == sorted(jobs)  # the sweep's own folder is not a run
        assert found[first][:2] == ["running", jobs[first]]
        for queued in (second, third):
            assert found[queued][0].startswith("queued") and found[queued][1] == jobs[queued]

        done = launch("cancel", RUN=str(tmp_path / "digits" / third))
        assert done.stdout.startswith(f"cancelled SLURM job {jobs[third]} (queued)"), done
        done = launch("cancel", RUN=str(tmp_path / "digits" / first))
        assert done.stdout.startswith(f"asked SLURM job {jobs[first]} to stop"), done
        out, err = sweep.communicate(timeout=300)  # ends by itself: no task is left
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 1, err
    assert "Bypassing" not in err and "sacct" not in err, err
    for stopped in (first, third):
        assert f"member {stopped} (job {jobs[stopped]}) ended without finishing" in err, err
    assert "1 of 3 members finished (1 unfinished, 1 missing)" in err, err  # 3rd never ran
    found = rows(launch("status", RUNS=f"{tmp_path}/digits/one-*").stdout)
    assert [found[n][:2] for n in (first, second, third)] == [
        ["stopped", jobs[first]], ["finished", jobs[second]], ["stopped", jobs[third]],
    ]  # fmt: skip
