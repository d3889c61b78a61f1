"""Faults a single training process meets, each in a real process with real signals and real
files: what survives, what stops, and in how many lines it says so."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import checkpoint as ckpt
from engine.meter import clocked
from tests.helpers import (
    QUIET,
    REPO,
    PicklePayload,
    engine_env,
    final_weights,
    records,
    run_dir,
    run_engine,
    same_weights,
)

pytestmark = pytest.mark.slow
# Dropout draws from the RNG, so a resume that does not restore the RNG states is caught.
SHORT = ["train.max_steps=12", "ckpt.every_steps=2", "ckpt.keep=2", "model.dropout=0.3"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def reference(root, train_here):
    """The SHORT run through, trained in the test's process: every run compared with it
    starts a process of its own."""
    train_here(root, "reference", *SHORT)
    return final_weights(root, "reference")


@pytest.fixture(scope="module")
def stopped(root, train_here) -> Path:
    """A SHORT run stopped at step 6 (checkpoints 4 and 6), trained once in the test's
    process: each resume test resumes, tampers or refuses a copy of it in a process of its
    own."""
    train_here(root, "stopped", *SHORT, "train.stop_at_step=6")
    return run_dir(root, "stopped")


def copy_of(stopped: Path, root: Path, name: str) -> None:
    shutil.copytree(stopped, run_dir(root, name))


def one_error_line(out) -> str:
    lines = out.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    return lines[-1]


def checkpoints(root, name) -> dict[str, bytes]:
    folder = run_dir(root, name) / "checkpoints"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def start_engine(root, name, *overrides) -> subprocess.Popen:
    args = [sys.executable, "-m", "engine.train", "digits", *QUIET]
    args += [f"run.root={root}", f"run.name={name}", *overrides]
    return subprocess.Popen(
        args, cwd=REPO, env=engine_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_until(condition, proc, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.02)


# ---------------------------------------------------------------- unreadable checkpoints


def test_no_loadable_checkpoint_stops_before_training_and_deletes_nothing(root, stopped):
    copy_of(stopped, root, "unreadable")
    folder = run_dir(root, "unreadable") / "checkpoints"
    marker = root / "payload-ran"
    newest, older = ckpt.list_checkpoints(folder)
    torch.save({"model": PicklePayload(marker)}, newest)  # tampered
    older.write_bytes(older.read_bytes()[:200])  # torn
    before = checkpoints(root, "unreadable")
    metrics = (run_dir(root, "unreadable") / "metrics.jsonl").read_text()

    out = run_engine(root, "unreadable", *SHORT, check=False)
    assert out.returncode == 2
    line = one_error_line(out)
    assert newest.name in line and older.name in line and "UnpicklingError" in line
    assert "another run.name" in line
    assert not marker.exists(), "resume: auto ran the planted pickle payload"
    assert checkpoints(root, "unreadable") == before
    assert (run_dir(root, "unreadable") / "metrics.jsonl").read_text() == metrics


def test_a_tampered_newest_checkpoint_is_skipped_and_the_run_resumes_bitwise(
    root, reference, stopped
):
    copy_of(stopped, root, "tampered")
    folder = run_dir(root, "tampered") / "checkpoints"
    marker = root / "payload-ran-2"
    torch.save({"model": PicklePayload(marker)}, ckpt.checkpoint_path(folder, 6))
    out = run_engine(root, "tampered", *SHORT)
    assert "skipping unreadable checkpoint" in out.stderr and "step 4)" in out.stderr
    assert not marker.exists(), "resume: auto ran the planted pickle payload"
    assert same_weights(final_weights(root, "tampered"), reference)
    assert ckpt.list_checkpoints(folder)[0].name == "step-00000012.pt"


def test_a_torn_metrics_line_is_dropped_on_resume(root, reference, train_here):
    """The run got past its last checkpoint (step 6) and was killed after step 7, mid-write
    of step 8's metrics line: metrics.jsonl holds a record of a step the checkpoint does not
    cover and half a line. The resume says the torn line, drops it and the records after the
    checkpoint's step, and trains on to the same weights and the same metrics.jsonl as an
    uninterrupted run."""
    every_step = [*SHORT, "log.every_steps=1"]
    killed = run_engine(root, "torn", *every_step, "fault.signal_at_step=7", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    newest = ckpt.list_checkpoints(run_dir(root, "torn") / "checkpoints")[0]
    assert ckpt.step_of(newest) == 6
    assert [r["step"] for r in records(root, "torn", "train")] == list(range(1, 8))
    metrics = run_dir(root, "torn") / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"kind": "train", "step": 8, "lo')
    out = run_engine(root, "torn", *every_step)
    assert "metrics.jsonl: line 8 dropped, torn" in out.stderr, out.stderr[-2000:]
    steps = [r["step"] for r in records(root, "torn", "train")]
    assert steps == list(range(1, 13))  # each step once: no torn or repeated record
    assert same_weights(final_weights(root, "torn"), reference)
    train_here(root, "torn-reference", *every_step)
    assert measured(root, "torn") == measured(root, "torn-reference")


def measured(root, name) -> list[dict]:
    """Every record of metrics.jsonl in order, less what the clock decides (throughput and
    the time spent waiting for data)."""
    lines = (run_dir(root, name) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not clocked(k)} for line in lines]


# ---------------------------------------------------------------- the run directory


def test_resume_none_refuses_an_existing_run_and_overwrite_moves_it_aside(
    root, stopped, train_here
):
    copy_of(stopped, root, "again")
    metrics = (run_dir(root, "again") / "metrics.jsonl").read_text()
    out = run_engine(root, "again", *SHORT, "resume=none", check=False)
    assert out.returncode == 2 and "run.overwrite=true" in one_error_line(out)
    assert (run_dir(root, "again") / "metrics.jsonl").read_text() == metrics

    train_here(root, "again", *SHORT, "train.max_steps=4", "resume=none", "run.overwrite=true")
    (aside,) = root.glob("digits/again.replaced-*")
    assert (aside / "metrics.jsonl").read_text() == metrics
    assert (aside / "checkpoints" / "step-00000006.pt").exists()
    steps = [r["step"] for r in records(root, "again", "train")]
    assert steps == sorted(set(steps))
    assert "resuming" not in (run_dir(root, "again") / "train.log").read_text()
    assert ckpt.step_of(ckpt.list_checkpoints(run_dir(root, "again") / "checkpoints")[0]) == 4


@pytest.mark.parametrize(
    "change, refused",
    [("optim.lr=0.2", "optim.lr 0.1 -> 0.2"), ("train.batch_size=32", "train.batch_size 64 -> 32")],
)
def test_resuming_with_a_config_that_changes_the_run_is_refused(root, stopped, change, refused):
    name = f"drift-{change.split('=')[0]}"
    copy_of(stopped, root, name)
    config = (run_dir(root, name) / "config.yaml").read_text()
    before = checkpoints(root, name)
    out = run_engine(root, name, *SHORT, change, check=False)
    assert out.returncode == 2 and refused in one_error_line(out)
    assert (run_dir(root, name) / "config.yaml").read_text() == config  # not overwritten
    assert checkpoints(root, name) == before


@pytest.mark.parametrize(
    "change, refused",
    [("optim.lr=0.2", "another config (optim.lr 0.1 -> 0.2")],
)
def test_a_checkpoint_resumed_into_another_run_under_a_changed_config_is_refused(
    root, stopped, change, refused
):
    """resume=<another run's checkpoint>: no run under the new name to compare with, so the
    checkpoint's own config refuses the change (and nothing is left under the new name)."""
    source = stopped / "checkpoints" / "step-00000006.pt"
    out = run_engine(root, "drift-elsewhere", *SHORT, change, f"resume={source}", check=False)
    assert out.returncode == 2 and refused in one_error_line(out)
    assert not run_dir(root, "drift-elsewhere").exists()


def test_resuming_with_safe_changes_says_which(root, stopped):
    copy_of(stopped, root, "extend")
    out = run_engine(root, "extend", *SHORT, "train.max_steps=14", "log.every_steps=3")
    assert "train.max_steps 12 -> 14" in out.stderr and "log.every_steps 10 -> 3" in out.stderr
    assert json.loads((run_dir(root, "extend") / "summary.json").read_text())["steps"] == 14


def test_a_config_mistake_leaves_no_run_directory_behind(root):
    out = run_engine(root, "mistake", "train.batch_size=100000", check=False)
    assert out.returncode == 2
    one_error_line(out)
    assert not run_dir(root, "mistake").exists()


def test_a_run_directory_belongs_to_one_live_job(root, reference):
    first = start_engine(root, "locked", *SHORT, "fault.hang_at_step=3")
    try:
        wait_until(
            lambda: (run_dir(root, "locked") / "checkpoints" / "step-00000002.pt").exists(),
            first,
            "checkpoint of the first job",
        )
        second = run_engine(root, "locked", *SHORT, check=False)
        assert second.returncode == 2
        line = one_error_line(second)
        assert f"pid {first.pid}" in line and "in use by another job" in line
    finally:
        first.send_signal(signal.SIGKILL)  # the holder dies: its lock goes with it
        first.wait()
    third = run_engine(root, "locked", *SHORT)
    assert "resuming from" in third.stderr
    assert same_weights(final_weights(root, "locked"), reference)


def test_what_the_run_writes_is_not_writable_by_others(root):
    umask_zero = ["sh", "-c", 'umask 000 && exec "$0" "$@"', sys.executable, "-m", "engine.train"]
    run_engine(root, "private", "train.max_steps=2", prefix=umask_zero)
    top = run_dir(root, "private")
    for path in [top, *top.rglob("*")]:
        assert not path.stat().st_mode & 0o022, f"{path} is writable by group or others"


# ---------------------------------------------------------------- killed, interrupted, stopped


def test_killed_while_saving_keeps_the_previous_checkpoint_and_cleans_up(root, reference):
    proc = start_engine(root, "midsave", *SHORT, "fault.hang_in_save_at_step=6")
    folder = run_dir(root, "midsave") / "checkpoints"
    wait_until(lambda: any(folder.glob(".step-00000006.pt.*.tmp")), proc, "partial checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in ckpt.list_checkpoints(folder)][0] == "step-00000004.pt"
    assert ckpt.load(folder / "step-00000004.pt")["step"] == 4
    out = run_engine(root, "midsave", *SHORT)
    assert "removed .step-00000006.pt." in out.stderr and "step 4)" in out.stderr
    assert not list(folder.glob(".*.tmp"))
    assert same_weights(final_weights(root, "midsave"), reference)


# Every signal sets the same flag: one resume (SIGTERM's) proves the checkpoint resumes.
@pytest.mark.parametrize("sig,resume", [("SIGTERM", True), ("SIGINT", False), ("SIGUSR2", False)])
def test_a_stop_signal_checkpoints_at_the_next_agreed_step_and_exits_75(
    root, reference, sig, resume
):
    name = f"signal-{sig}"
    # The signal arrives after step 3; ranks agree at log steps (every 2): it stops at 4.
    out = run_engine(
        root,
        name,
        *SHORT,
        "log.every_steps=2",
        "fault.signal_at_step=3",
        f"fault.signal={sig}",
        check=False,
    )
    assert out.returncode == 75, out.stderr[-2000:]
    assert f"stopped at step 4 (preempted: {sig})" in out.stderr
    assert ckpt.list_checkpoints(run_dir(root, name) / "checkpoints")[0].name == "step-00000004.pt"
    if not resume:
        return
    resumed = run_engine(root, name, *SHORT, "log.every_steps=2")
    assert "step 4)" in resumed.stderr
    assert same_weights(final_weights(root, name), reference)


def test_a_second_ctrl_c_exits_at_once(root):
    # Ranks agree on a stop only every 1000 steps here, so only the second Ctrl-C can end it.
    proc = start_engine(
        root, "twice", "train.max_steps=100000", "log.every_steps=1000", "ckpt.every_steps=2"
    )
    folder = run_dir(root, "twice") / "checkpoints"
    wait_until(lambda: (folder / "step-00000002.pt").exists(), proc, "first checkpoint")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None, "the first Ctrl-C should only ask for a stop"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "press Ctrl-C again" in err and "second interrupt: exiting now" in err
    assert "Traceback" not in err
    newest = ckpt.list_checkpoints(folder)[0]
    assert ckpt.load(newest)["step"] == int(newest.stem.split("-")[1])  # complete, loads


# The engine's main, then what CPython does as it shuts down (_PySignal_Fini): each handler
# Python installed goes back to SIG_DFL; then SLURM's time-limit warning arrives.
MAIN_THEN_SHUTDOWN_AND_USR2 = """
import os, signal, sys
from engine.cli import main
code = main(sys.argv[1:])
if callable(signal.getsignal(signal.SIGUSR2)):
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
os.kill(os.getpid(), signal.SIGUSR2)
sys.exit(code)
"""


def test_a_time_limit_warning_while_a_finished_run_exits_leaves_it_finished(root):
    """A SIGUSR2 that arrives once training is over has nothing left to save: the process
    still exits 0 (it was killed by the signal, exit 140 under srun, and SLURM marked the
    finished job FAILED)."""
    argv = ["digits", *QUIET, f"run.root={root}", "run.name=late", "train.max_steps=2"]
    command = [sys.executable, "-c", MAIN_THEN_SHUTDOWN_AND_USR2, *argv]
    done = subprocess.run(
        command, cwd=REPO, env=engine_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run_dir(root, "late") / "summary.json").is_file()


# ---------------------------------------------------------------- numbers and disks


def test_non_finite_gradients_stop_before_the_next_checkpoint(root):
    out = run_engine(root, "nan", *SHORT, "fault.nan_at_step=5", "log.every_steps=1", check=False)
    assert out.returncode == 1
    line = one_error_line(out)
    assert "non-finite gradients at step 5" in line and "step-00000004.pt" in line
    assert "train.nan_policy=skip" in line
    names = [p.name for p in ckpt.list_checkpoints(run_dir(root, "nan") / "checkpoints")]
    assert names[0] == "step-00000004.pt"
    # Continue, skipping such steps: the NaN step is skipped, counted, and training goes on.
    skip = ["fault.nan_at_step=5", "log.every_steps=1", "train.nan_policy=skip"]
    out = run_engine(root, "nan", *SHORT, *skip)
    assert "non-finite gradients at step 5; step skipped" in out.stderr
    last = records(root, "nan", "train")[-1]
    assert last["skipped_steps"] == 1 and last["step"] == 12
    weights = final_weights(root, "nan")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


@pytest.mark.parametrize(
    "where, options, kept",
    [
        ("mid_epoch", [*SHORT, "fault.nan_at_step=5"], "step-00000004.pt"),
        ("epoch_end", ["train.epochs=2", "ckpt.every_steps=0", "fault.nan_at_step=22"], None),
    ],
)
def test_a_non_finite_step_between_log_records_never_reaches_a_checkpoint(
    root, where, options, kept
):
    """nan_policy=stop checks the norms a window holds before each checkpoint, not only at
    log records: no record falls between the bad step and the checkpoint here (digits: 22
    steps an epoch, the second case's bad step the epoch's last)."""
    out = run_engine(root, f"nan-{where}", *options, "log.every_steps=100", check=False)
    assert out.returncode == 1
    line = one_error_line(out)
    step = options[-1].split("=")[1]
    assert f"non-finite gradients at step {step}" in line
    names = [p.name for p in ckpt.list_checkpoints(run_dir(root, f"nan-{where}") / "checkpoints")]
    assert names[:1] == ([kept] if kept else [])
    assert (kept or "no checkpoint was saved") in line


def test_the_gradient_norm_is_logged_with_the_loss(root, reference):
    rec = records(root, "reference", "train")[0]
    assert rec["grad_norm"] > 0 and rec["loss"] > 0


def test_skip_policy_leaves_the_weights_of_a_skipped_step_unchanged(root):
    base = ["train.max_steps=5", "ckpt.every_steps=1", "ckpt.keep=10", "train.nan_policy=skip"]
    run_engine(root, "skip", *base, "fault.nan_at_step=5")
    folder = run_dir(root, "skip") / "checkpoints"
    before, after = (ckpt.load(ckpt.checkpoint_path(folder, s)) for s in (4, 5))

    # Parameters stay; batch-norm statistics come from the forward pass, which did happen.
    def weights(state):
        return {
            k: v for k, v in state["model"].items() if "running" not in k and "batches" not in k
        }

    assert same_weights(weights(before), weights(after))
    assert not same_weights(weights(ckpt.load(ckpt.checkpoint_path(folder, 3))), weights(before))
    assert after["scheduler"]["last_epoch"] == 5  # the schedule still follows the step


def fill_or_lock(root: Path, folder: Path) -> str:
    """Make the next checkpoint write fail for real: as root (whom permissions do not stop)
    fill the small tmpfs the run lives on, otherwise make the folder read-only."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return "Permission denied"
    stats = os.statvfs(root)
    room = 16 * 1024  # enough for the run's small files, not for a checkpoint
    (root / "filler").write_bytes(b"\0" * (stats.f_bavail * stats.f_frsize - room))
    return "No space left on device"


def test_a_full_or_read_only_disk_while_checkpointing_keeps_the_last_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    try:
        run_engine(disk, "full", *SHORT, "train.stop_at_step=2", "log.every_steps=100")
        folder = run_dir(disk, "full") / "checkpoints"
        reason = fill_or_lock(disk, folder)
        out = run_engine(disk, "full", *SHORT, "log.every_steps=100", check=False)
        folder.chmod(0o755)
        assert out.returncode == 1
        line = one_error_line(out)
        assert reason in line and "step-00000002.pt is intact" in line
        assert [p.name for p in folder.iterdir()] == ["step-00000002.pt"]  # no partial file
        assert ckpt.load(folder / "step-00000002.pt")["step"] == 2
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(disk)], check=True)
