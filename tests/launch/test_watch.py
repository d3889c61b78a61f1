"""`make status`, `make logs`, `make cancel` on local runs: a real digits run started in the
background, watched, followed and cancelled (a checkpoint, then `stopped`); a finished run and
a failed one read as such; run folders written by hand for the cases no short run reaches (a
killed run, a stale stop mark, SLURM out of reach); user mistakes in one line.
The SLURM side is tests/slurm/test_watch_slurm.py."""

from __future__ import annotations

import json
import os
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
# Slow enough to be caught running (a 20 ms wait per batch), stopped long before its end.
LONG = ["train.max_steps=5000", "log.every_steps=2", "ckpt.every_steps=0", "fault.data_delay_ms=20"]


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    return helpers.launch(*args, timeout=120, **env)


def make(*args: str) -> subprocess.CompletedProcess:
    env = helpers.launch_env(helpers.engine_env())
    return subprocess.run(
        ["make", "-s", "-o", STAMP, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def rows(out: str) -> dict[str, list[str]]:
    """status's table: {run path: [state, job, nodes, step, eval, last line...]} (a state with
    a note in brackets is one cell: cells are split at two spaces)."""
    lines = out.strip().splitlines()
    assert lines[0].startswith("RUN "), out
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in lines[1:])}


def wait_for(what, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s"
        time.sleep(0.1)
    return found


def logged(run: Path, text: str) -> bool:
    log = run / rundir.LOG_NAME
    return log.is_file() and text in log.read_text()


@pytest.fixture(scope="module")
def root(tmp_path_factory, train_here) -> Path:
    """A finished run (trained in this process) and a failed one (a process whose error was
    raised after step 3)."""
    root = tmp_path_factory.mktemp("runs")
    train_here(root, "done", "train.max_steps=4", "log.every_steps=2")
    failed = helpers.run_engine(
        root, "broken", "train.max_steps=40", "log.every_steps=1", "fault.raise_at_step=3",
        check=False,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr[-2000:]
    return root


@pytest.mark.slow
def test_a_local_run_watched_followed_and_cancelled_stops_with_a_checkpoint(tmp_path):
    run = helpers.run_dir(tmp_path, "long")
    args = [sys.executable, "-m", "engine.train", "digits", *helpers.QUIET, *LONG]
    args += [f"run.root={tmp_path}", "run.name=long"]
    out = (tmp_path / "engine.log").open("w")  # not a pipe: one nobody reads fills and blocks
    engine = subprocess.Popen(args, cwd=ROOT, env=helpers.engine_env(), stdout=out, stderr=out)
    follower = None
    try:
        wait_for(lambda: logged(run, "step 4/5000"))  # rank 0's lines reach its train.log
        state, job, nodes, step, _, last = rows(make("status", f"RUNS={run}").stdout)[str(run)]
        assert (state, job) == ("running", "-"), last
        assert int(step.split("/")[0]) >= 4 and step.endswith("/5000")
        assert last.startswith("step ") and "/5000" in last

        follower = subprocess.Popen(
            [sys.executable, "-m", "launch", "logs"], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            env=helpers.launch_env(helpers.engine_env(), RUN=str(run), FOLLOW="1"),
        )  # fmt: skip
        done = make("cancel", f"RUN={run}")
        assert done.returncode == 0 and f"asked pid {engine.pid} to stop" in done.stdout, done
        assert engine.wait(timeout=120) == 75, (tmp_path / "engine.log").read_text()[-2000:]
        out, err = follower.communicate(timeout=60)  # ends by itself with the run
    finally:
        for proc in (engine, follower):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert follower.returncode == 0, err
    assert "stopped at step" in out and "(preempted: SIGTERM); checkpoint saved" in out, out
    end = json.loads((run / rundir.STATE_NAME).read_text())
    assert (end["state"], end["exit_code"]) == ("stopped", 75), end
    assert (run / "checkpoints" / f"step-{end['step']:08d}.pt").is_file()
    state, _, _, step, *_ = rows(launch("status", RUNS=str(run)).stdout)[str(run)]
    assert (state, step) == ("stopped", f"{end['step']}/5000")
    again = launch("cancel", RUN=str(run))
    assert (again.returncode, again.stderr) == (
        2, f"launch: {run} is not running (stopped); nothing to stop\n"
    )  # fmt: skip


def test_a_finished_and_a_failed_run_read_as_such(root):
    found = rows(launch("status", RUNS=f"{root}/digits/*").stdout)
    done, broken = str(helpers.run_dir(root, "done")), str(helpers.run_dir(root, "broken"))
    assert list(found) == [str(helpers.run_dir(root, "broken")), done]
    state, job, _, step, evaluation, last = found[done]
    assert (state, job, step) == ("finished", "-", "4/4")
    summary = json.loads((Path(done) / "summary.json").read_text())
    assert evaluation == f"top1 {100 * summary['top1']:.2f}%"  # as the log says it
    assert last.startswith("digits: top1 ") and "4 steps" in last
    state, _, _, step, evaluation, last = found[broken]
    assert (state, step, evaluation) == ("failed (exit 1)", "3/40", "-")
    assert last == "error: InjectedFault: injected fault at step 3 on rank 0"
    logs = launch("logs", RUN=broken)
    assert logs.returncode == 0 and logs.stdout.splitlines()[-1] == last
    assert "step 3/40" in logs.stdout


def test_the_default_is_every_run_under_runs_and_recipe_filters(root, tmp_path):
    env = {"PYTHONPATH": str(ROOT)}
    out = helpers.launch("status", cwd=tmp_path, **env)  # runs/ of the working folder
    assert (out.returncode, out.stdout) == (0, "no runs under runs/; make status RUNS='<run dir or pattern> ...'\n")  # fmt: skip
    (tmp_path / "runs").symlink_to(root)
    found = rows(helpers.launch("status", cwd=tmp_path, **env).stdout)
    assert set(found) == {"runs/digits/broken", "runs/digits/done"}
    other = helpers.launch("status", cwd=tmp_path, RECIPE="gpt", **env)
    assert other.stdout == "no runs under runs/gpt/; make status RUNS='<run dir or pattern> ...'\n"


def fake_run(root: Path, name: str, **files: str) -> Path:
    run = root / "digits" / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: digits\ntrain:\n  max_steps: 10\n")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 6, "loss": 1.0}\n')
    for name_, text in files.items():
        path = run / name_.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return run


def test_a_killed_run_is_failed_and_a_stale_stop_mark_is_not_read(tmp_path):
    holder = json.dumps(
        {"host": "h", "pid": 1, "slurm_job_id": None, "since": "2030-01-01 00:00:00"}
    )
    killed = fake_run(
        tmp_path, "killed", **{"state.json": '{"state": "running", "steps": 10}', ".lock": holder}
    )
    (killed / rundir.STOP_NAME).write_text("{}")  # from before its latest start: stale
    stopped = fake_run(tmp_path, "stopped", **{".lock": holder.replace("2030", "2020")})
    (stopped / rundir.STOP_NAME).write_text("{}")  # after it: this start was asked to stop
    found = rows(launch("status", RUNS=f"{tmp_path}/digits/*").stdout)
    assert found[str(killed)][:4] == ["failed", "-", "-", "6/10"]
    assert found[str(stopped)][:4] == ["stopped", "-", "-", "6/10"]


def test_slurm_out_of_reach_is_one_line_and_the_folders_still_read(tmp_path):
    run = fake_run(tmp_path, "job", **{"slurm__7_submitted.pkl": "", "slurm__7_0_log.err": "a\nlast words\n", "summary.json": '{"top1": 0.5, "headline": "top1"}'})  # fmt: skip
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "squeue").exists())  # fmt: skip
    out = launch("status", RUNS=str(run), PATH=path)
    assert out.returncode == 0
    assert out.stderr == (
        "launch: SLURM is not reachable (squeue is not on PATH); SLURM jobs' states below are "
        "read from their run folders alone\n"
    )
    assert rows(out.stdout)[str(run)] == ["finished", "7", "-", "6/10", "top1 50.00%", "last words"]


@pytest.mark.parametrize(
    ("command", "env", "message"),
    [
        ("logs", {}, "launch: logs needs RUN=<run dir>, e.g. make logs RUN=runs/digits/NAME"),
        ("cancel", {"RUN": "nowhere"}, "launch: RUN=nowhere is not a directory; give a run directory, runs/<recipe>/<name>"),
        ("status", {"RUNS": "nowhere/*"}, "launch: RUNS: nowhere/* matches no path; check the pattern"),
        ("status", {"RUNS": "'"}, "launch: RUNS cannot be split into paths (No closing quotation); check its quotes"),
    ],
)  # fmt: skip
def test_a_mistake_is_one_line_with_the_fix(command, env, message):
    out = launch(command, **env)
    assert (out.returncode, out.stderr, out.stdout) == (2, message + "\n", "")


def test_cancel_of_a_folder_that_is_no_run_is_one_line(tmp_path):
    out = launch("cancel", RUN=str(tmp_path))
    assert out.returncode == 2
    assert (
        out.stderr
        == f"launch: RUN={tmp_path} is not a run directory (no config.yaml, lock or slurm/)\n"
    )


def test_status_shows_the_engine_s_last_line_not_srun_s_or_submitit_s(tmp_path):
    err = "step 12/40 loss 0.3\nstopped at step 12 (preempted: SIGTERM); checkpoint saved\n"
    err += "srun: error: node1: task 0: Exited with exit code 75\n"
    out = "submitit INFO (2026-12-06 07:00:09,864) - Exiting after successful completion\n"
    run = fake_run(tmp_path, "job", **{"slurm__8_0_log.err": err, "slurm__8_0_log.out": out})
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "squeue").exists())  # fmt: skip
    found = rows(launch("status", RUNS=str(run), PATH=path).stdout)[str(run)]
    assert found[-1] == "stopped at step 12 (preempted: SIGTERM); checkpoint saved"


def test_a_run_make_sbatch_prepared_is_listed_as_prepared_not_unknown(tmp_path):
    """make sbatch freezes the request in the run folder before anything is submitted: until
    a job of it starts, status says so instead of `unknown` for ever."""
    run = tmp_path / "digits" / "bysbatch"
    (run / "request").mkdir(parents=True)
    (run / "request" / "0123456789ab.yaml").write_text("recipe: digits\n")
    found = rows(launch("status", RUNS=f"{tmp_path}/digits/*").stdout)
    assert found[str(run)][:2] == ["prepared (sbatch FILE submits it)", "-"]


@pytest.mark.slow
def test_a_refused_resume_leaves_a_finished_run_finished_with_the_refusal_beside_it(root, tmp_path):
    """Relaunching a finished run with a config that drifted is refused (exit 2) before it
    starts: the run is still finished; the refused attempt is noted, not put in its place."""
    import shutil

    run = helpers.run_dir(tmp_path, "done")
    shutil.copytree(helpers.run_dir(root, "done"), run)
    refused = helpers.run_engine(
        tmp_path, "done", "train.max_steps=8", "log.every_steps=2", "optim.lr=0.9", check=False
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    state = json.loads((run / rundir.STATE_NAME).read_text())
    assert state["state"] == "finished" and state["refused"]["exit_code"] == 2, state
    found = rows(launch("status", RUNS=str(run)).stdout)[str(run)]
    assert found[:4] == ["finished (a later launch was refused, exit 2)", "-", found[2], "4/4"]


def test_a_failed_job_shows_the_engine_s_line_even_after_slurm_forgot_it(tmp_path):
    """A submitted job that failed (a check on the node, a setup line) and that SLURM no
    longer knows: status says failed with the engine's own line, not the wrapper's
    traceback, nor `prepared` for a frozen request no job will start."""
    err = "error: the training set has 409 samples, fewer than train.batch_size=512: lower\n"
    err += 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
    err += "RuntimeError: engine.train exited with code 2: the training set has 409 samples\n"
    err += "srun: error: node1: task 0: Exited with exit code 1\n"
    run = fake_run(tmp_path, "job", **{"slurm__9_0_log.err": err, "request__0123.yaml": "a: 1\n"})
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "squeue").exists())  # fmt: skip
    found = rows(launch("status", RUNS=str(run), PATH=path).stdout)[str(run)]
    assert found[:2] == ["failed", "9"]
    assert found[-1] == err.splitlines()[0]


def test_a_sweep_s_folder_is_watched_through_its_members(tmp_path):
    """make status RUNS=<sweep folder> lists its members (the folder is no run); make logs of
    it says where the runs are, in one line."""
    members = [fake_run(tmp_path, f"lr-seed{i}") for i in range(2)]
    folder = tmp_path / "digits" / "lr-sweep"
    folder.mkdir()
    (folder / "sweep.json").write_text(json.dumps({"members": {m.name: {} for m in members}}))
    found = rows(launch("status", RUNS=str(folder)).stdout)
    assert list(found) == [str(m) for m in members]
    done = launch("logs", RUN=str(folder))
    assert done.returncode == 2
    assert done.stderr == (
        f"launch: RUN={folder} is a sweep's folder, not a run: make status RUNS={folder} lists "
        f"its 2 member(s); make logs RUN=<a member> (e.g. RUN={members[0]})\n"
    )
