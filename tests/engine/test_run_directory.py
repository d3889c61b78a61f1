"""Claiming a run directory, in this process (engine.lifecycle.train, as `python -m engine.train`
runs it): a root that cannot be written is one line and leaves nothing; a run that finished
is not trained again; a live run's lock is refused before anything says "resuming"."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from engine import cli, lifecycle, preempt, rundir
from engine.catalog import load_config
from engine.config import ConfigError

QUIET = ["log.wandb=off", "log.progress=off", "device=cpu"]


pytestmark = pytest.mark.usefixtures("restore_backend_flags")  # tests/engine/conftest.py


def train_run(root, name: str, *overrides: str) -> int:
    cfg, recipe = load_config(
        "digits", [*QUIET, f"run.root={root}", f"run.name={name}", *overrides]
    )
    return lifecycle.train(cfg, recipe)


def test_a_root_that_cannot_be_written_is_one_line_with_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(preempt, "install_handlers", lambda: None)  # pytest keeps its own
    rc = cli.main(["digits", *QUIET, "run.root=/proc/runs", "run.name=r", "train.max_steps=1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.splitlines() == [
        "error: cannot create the run directory /proc/runs/digits/r (No such file or "
        "directory); set run.root to a writable folder"
    ]


def test_a_run_directory_that_cannot_be_made_leaves_no_folder_behind(tmp_path):
    root = tmp_path / "new" / "runs"
    with pytest.raises(ConfigError, match=r"cannot create the run directory .*File name too long"):
        train_run(root, "x" * 300, "train.max_steps=1")  # made root/digits, then failed
    assert list(tmp_path.iterdir()) == []


def test_a_refused_launch_leaves_no_run_directory_behind(tmp_path):
    with pytest.raises(ConfigError):
        train_run(tmp_path, "mistake", "train.batch_size=100000")
    assert list(tmp_path.iterdir()) == []


def test_a_finished_run_is_not_trained_again(tmp_path, capsys):
    assert train_run(tmp_path, "done", "train.max_steps=1") == 0
    folder = tmp_path / "digits" / "done"
    before = {f: (folder / f).read_bytes() for f in ("summary.json", "metrics.jsonl")}
    capsys.readouterr()
    assert train_run(tmp_path, "done", "train.max_steps=1") == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"run {folder} already finished at step 1; nothing to do (start another with a new "
        "run.name)"
    ]
    assert {f: (folder / f).read_bytes() for f in before} == before
    # more steps asked for: the run goes on from its checkpoint
    assert train_run(tmp_path, "done", "train.max_steps=2") == 0
    assert "resuming from" in capsys.readouterr().err
    assert json.loads((folder / "summary.json").read_text())["steps"] == 2


def test_a_finished_run_is_never_done_for_another_request(tmp_path, capsys):
    """One name, one request: a second request under a finished run's name (a queued job
    that finds it done, engine.lifecycle; a check before the queue, engine.cli) is refused
    naming the differing key, never "nothing to do", and the run stays as it was."""
    assert train_run(tmp_path, "one", "train.max_steps=1") == 0
    folder = tmp_path / "digits" / "one"
    before = {f: (folder / f).read_bytes() for f in ("summary.json", "metrics.jsonl")}
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"another request \(optim.lr 0.1 -> 0.3\)"):
        train_run(tmp_path, "one", "train.max_steps=1", "optim.lr=0.3")
    assert "nothing to do" not in capsys.readouterr().err
    assert {f: (folder / f).read_bytes() for f in before} == before
    state = json.loads((folder / rundir.STATE_NAME).read_text())
    assert state["state"] == "finished" and "optim.lr 0.1 -> 0.3" in state["refused"]["why"]
    argv = ["digits", *QUIET, f"run.root={tmp_path}", "run.name=one", "train.max_steps=1"]
    assert cli.main([*argv, "optim.lr=0.3", "--check", "1"]) == 2
    assert "optim.lr 0.1 -> 0.3" in capsys.readouterr().err
    assert cli.main([*argv, "log.every_steps=5", "--check", "1"]) == 0  # resume-safe


def test_a_live_run_is_refused_before_anything_says_resuming(tmp_path, capsys):
    assert train_run(tmp_path, "live", "train.max_steps=2", "train.stop_at_step=1") == 0
    capsys.readouterr()
    lock = tmp_path / "digits" / "live" / rundir.LOCK_NAME
    other = os.open(lock, os.O_RDWR)  # another job's hold: its own open file
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConfigError, match="in use by another job"):
            train_run(tmp_path, "live", "train.max_steps=2")
    finally:
        os.close(other)
    assert "resuming" not in capsys.readouterr().err
    assert train_run(tmp_path, "live", "train.max_steps=2") == 0  # once it is free
    assert "resuming from" in capsys.readouterr().err


def test_a_weights_path_too_long_for_the_file_system_belongs_to_no_run(tmp_path):
    """`make eval CKPT=<a name longer than NAME_MAX>` said a traceback (ENAMETOOLONG from
    the config lookup) where it must go on to the missing checkpoint's one line."""
    assert rundir.run_config_of(tmp_path / ("x" * 5000)) is None


def test_overwrite_moves_the_earlier_run_aside_but_not_the_submission_running_now(tmp_path):
    """run.overwrite in a SLURM job: the job imports its code snapshot and a requeue reads its
    frozen request, both in the run directory; the earlier run's results go aside."""
    run = tmp_path / "digits" / "r"
    for name in ("metrics.jsonl", "config.yaml", "checkpoints/step-00000004.pt",
                 "code/abc/engine/x.py", "request/0123.yaml", "slurm/7_0_log.err",
                 "submitted.json", rundir.LOCK_NAME):  # fmt: skip
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(name)
    aside = rundir.move_aside(run)
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [*rundir.SUBMISSION_ENTRIES, rundir.LOCK_NAME]
    )
    assert sorted(p.name for p in aside.iterdir()) == [
        "checkpoints",
        "config.yaml",
        "metrics.jsonl",
    ]


def test_an_array_task_names_its_job_as_scancel_addresses_it_alone():
    """A sweep's member: SLURM_JOB_ID alone may be the array's id, which names every task."""
    task = {"SLURM_JOB_ID": "23", "SLURM_ARRAY_JOB_ID": "23", "SLURM_ARRAY_TASK_ID": "0"}
    assert rundir.slurm_job(task) == "23_0"
    assert rundir.slurm_job({"SLURM_JOB_ID": "24"}) == "24" and rundir.slurm_job({}) is None
    assert rundir.slurm_restarts({"SLURM_RESTART_COUNT": "2"}) == 2
    assert rundir.slurm_restarts({}) == 0


def test_a_resumed_run_s_time_is_the_sum_of_its_starts(tmp_path):
    """summary.json's seconds count every start up to its checkpoint, not the last start
    alone (a requeued run's time per cell would read short)."""
    import time

    from engine import checkpoint as ckpt

    t0 = time.perf_counter()
    assert train_run(tmp_path, "twice", "train.max_steps=2", "train.stop_at_step=1") == 0
    first = time.perf_counter() - t0
    folder = tmp_path / "digits" / "twice"
    (stopped,) = ckpt.list_checkpoints(folder / "checkpoints")
    at_stop = ckpt.load(stopped)["seconds"]
    t0 = time.perf_counter()
    assert train_run(tmp_path, "twice", "train.max_steps=2") == 0
    second = time.perf_counter() - t0
    total = json.loads((folder / "summary.json").read_text())["seconds"]
    assert 0 < at_stop <= first
    assert at_stop < total <= first + second  # this start's time added to the first's
    assert total - at_stop <= second


def test_a_stopped_sweep_member_is_told_to_rerun_its_sweep(tmp_path, capsys, monkeypatch):
    """Not its own run.name: that would train the member outside its sweep's record."""
    assert train_run(tmp_path, "alone", "train.max_steps=2", "train.stop_at_step=1") == 0
    assert "Resume: rerun with run.name=alone" in capsys.readouterr().err
    monkeypatch.setenv(lifecycle.SWEEP_VARIABLE, "lr")
    assert train_run(tmp_path, "lr-seed0", "train.max_steps=2", "train.stop_at_step=1") == 0
    err = capsys.readouterr().err
    assert "Resume: rerun sweep lr (the same make sweep command; it runs what is left)" in err


def test_a_value_set_up_derives_is_the_same_request_as_the_one_it_derived():
    """model.num_classes=0 asks set-up to count the classes: a run whose config.yaml holds the
    count is the same request; another count asked outright is not."""
    from engine.config import identity

    saved = {"model": {"num_classes": 3}, "optim": {"lr": 0.1}}
    assert (
        identity.request_changes(saved, {"model": {"num_classes": 0}, "optim": {"lr": 0.1}}) == []
    )
    changes = identity.request_changes(saved, {"model": {"num_classes": 5}, "optim": {"lr": 0.1}})
    assert changes == ["model.num_classes 3 -> 5"]
