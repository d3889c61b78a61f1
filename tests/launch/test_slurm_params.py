"""launch.slurm: submitit parameters from a request, and how a finished engine run ends a
SLURM task (requeue on 75), checked against submitit's own job entry point."""

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import submitit
from submitit.core import utils as submitit_utils

from engine import preempt
from engine.config import SlurmConfig
from launch import render, request, slurm
from launch.errors import UserError
from launch.render import LaunchRequest, Slurm
from tests.helpers import copy_torch_free_engine

ROOT = Path(__file__).resolve().parents[2]
FULL = Slurm(
    partition="gpu",
    account="acct",
    qos="high",
    time_min=90,
    cpus_per_task=8,
    mem_gb=64,
    constraint="h100",
    exclude="bad1",
    setup=("module load cuda",),
    signal_delay_s=300,
)


def req(**kw) -> LaunchRequest:
    base = dict(recipe="digits", run_name="RUN", python="/venv/bin/python", src="/src")
    base["device"] = "cpu" if not kw.get("gpus") else ""  # GPUS=0 asks for device=cpu
    return LaunchRequest(**{**base, **kw})


def test_parameters_of_a_multi_node_gpu_job():
    assert slurm.executor_parameters(req(gpus=4, nodes=2, slurm=FULL)) == {
        "job_name": "RUN",
        "nodes": 2,
        "ntasks_per_node": 4,
        "gpus_per_node": 4,
        "cpus_per_task": 8,
        "mem": "64G",
        "time": 90,
        "partition": "gpu",
        "account": "acct",
        "qos": "high",
        "constraint": "h100",
        "exclude": "bad1",
        "signal_delay_s": 300,
        "setup": [
            *render.guarded(("module load cuda",), nodes=2),  # and once more on each node
            "export TORCH_FR_BUFFER_SIZE=2000",  # NCCL's flight recorder, into the run's hang/
            "export TORCH_NCCL_DUMP_ON_TIMEOUT=1",
            "export TORCH_FR_DUMP_TEMP_FILE=runs/digits/RUN/hang/nccl_trace_rank_",
            'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
        ],
        "additional_parameters": {"requeue": True, "chdir": "/src"},
    }


def test_cpu_job_has_one_task_per_process_and_no_gpus():
    params = slurm.executor_parameters(req(gpus=0, procs=3))
    assert params["ntasks_per_node"] == 3 and "gpus_per_node" not in params
    for unset in ("partition", "account", "mem", "cpus_per_task", "setup"):
        assert unset not in params


def test_engine_job_carries_the_run_name_so_a_requeue_keeps_the_run():
    job = slurm.engine_job(req(gpus=0, overrides=("optim.lr=0.2",)))
    assert (job.recipe, job.args) == ("digits", ["device=cpu", "run.name=RUN", "optim.lr=0.2"])
    assert isinstance(job, submitit.helpers.Checkpointable)
    again = job.checkpoint()  # what submitit pickles if its own handler ever runs
    assert again.function is job and again.args == () and again.kwargs == {}


@pytest.fixture
def fake_slurm_bin(tmp_path, monkeypatch):
    """srun/sbatch/scontrol/sinfo stand-ins; each appends its argv to calls.txt. sinfo lists
    two large nodes (the real one, with no controller to ask, retries for seconds)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.txt"
    nodes = "".join(f"n{i} {p} 64 1048576\\n" for p in ("debug*", "gpu") for i in (1, 2))
    for name, body in {
        "srun": "",
        "scontrol": "",
        "sinfo": f"printf '{nodes}'",
        "sbatch": 'cp "$1" "$(dirname "$FAKE_CALLS")/script.sh"; echo "Submitted batch job 4242"',
    }.items():
        path = bindir / name
        path.write_text(f'#!/bin/bash\necho "{name} $*" >> "$FAKE_CALLS"\n{body}\n')
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CALLS", str(log))
    return log


def test_submitit_renders_the_parameters_into_its_sbatch_script(fake_slurm_bin, tmp_path):
    r = req(gpus=4, nodes=2, slurm=FULL, src=str(tmp_path))
    job = slurm.executor(r, tmp_path / "slurm").submit(slurm.engine_job(r))
    assert job.job_id == "4242"
    script = (tmp_path / "script.sh").read_text()
    for line in (
        "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=8",
        "--mem=64G", "--time=90", "--partition=gpu", "--account=acct", "--qos=high",
        "--constraint=h100", "--exclude=bad1", "--signal=USR2@300", "--requeue",
        f"--chdir={tmp_path}", "--job-name=RUN",
    ):  # fmt: skip
        assert f"#SBATCH {line}\n" in script, line
    assert "\n{ module load cuda\n} || { rc=$?; echo 'error: setup line 1 failed on '" in script
    assert "\nsrun --nodes=$SLURM_JOB_NUM_NODES --ntasks-per-node=1 " in script  # every node
    pickled = submitit_utils.DelayedSubmission.load(tmp_path / "slurm" / "4242_submitted.pkl")
    assert isinstance(pickled.function, slurm.EngineJob)
    assert pickled.function.args == render.engine_args(r)[1:]


def test_dry_run_is_the_script_a_submission_writes(fake_slurm_bin, tmp_path):
    r = req(gpus=4, nodes=2, slurm=FULL, src=str(tmp_path))
    folder = slurm.job_folder(r)
    printed = slurm.dry_run([r], folder, r.run_name)
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    slurm.executor(r, folder, job_name=r.run_name).submit(slurm.engine_job(r))
    script, _, tasks = printed.partition("# Each task unpickles its job and runs:")
    assert script == (tmp_path / "script.sh").read_text()
    expected = render.shell_join(["python", "-m", "engine.train", *render.engine_args(r)])
    assert tasks.strip() == f"#   every task: {expected}"


def test_dry_run_of_a_sweep_is_the_array_a_submission_writes(fake_slurm_bin, tmp_path):
    reqs = [req(gpus=0, run_name=f"B-seed{i}", src=str(tmp_path)) for i in range(3)]
    printed = slurm.dry_run(reqs, tmp_path / "sweep" / "slurm", "B")
    slurm.submit_array(reqs, [""] * 3, tmp_path / "sweep" / "slurm", name="B")
    script, _, tasks = printed.partition("# Each task unpickles its job and runs:")
    assert script == (tmp_path / "script.sh").read_text()
    assert "#SBATCH --array=0-2%3\n" in script
    assert [line.split()[3] for line in tasks.strip().splitlines()] == ["0:", "1:", "2:"]
    assert "run.name=B-seed2" in tasks.strip().splitlines()[2]


@pytest.mark.parametrize(
    ("stderr", "said", "hint"),
    [
        (
            "sbatch: error: Batch job submission failed: Unable to contact slurm controller "
            "(connect failure)",
            "Batch job submission failed: Unable to contact slurm controller (connect failure)",
            "is slurmctld running",
        ),
        (
            "sbatch: error: invalid partition specified: nope\nsbatch: error: Batch job "
            "submission failed: Invalid partition name specified",
            "Batch job submission failed: Invalid partition name specified",
            "check PARTITION",
        ),
        (
            "sbatch: error: Batch job submission failed: Requested time limit is invalid "
            "(missing or exceeds some limit)",
            "Batch job submission failed: Requested time limit is invalid (missing or exceeds "
            "some limit)",
            "lower TIME_MIN",
        ),
        (  # SLURM's own words for a QOS's submit limit: not a partition's time limit
            "sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission "
            "failed: Job violates accounting/QOS policy (job submit limit, user's size and/or "
            "time limits)",
            "Batch job submission failed: Job violates accounting/QOS policy (job submit limit, "
            "user's size and/or time limits)",
            "your QOS or association caps your jobs",
        ),
        (
            "sbatch: error: Batch job submission failed: Invalid account or account/partition "
            "combination specified",
            "Batch job submission failed: Invalid account or account/partition combination "
            "specified",
            "check ACCOUNT",
        ),
        (
            "sbatch: error: Batch job submission failed: Requested node configuration is not "
            "available",
            "Batch job submission failed: Requested node configuration is not available",
            "the request exceeds every node",  # not "is slurmctld running"
        ),
    ],
)
def test_slurm_refusals_are_one_line_with_what_to_check(stderr, said, hint):
    line = slurm.slurm_error(stderr)
    assert "\n" not in line
    assert f"SLURM refused the job: {said}; {hint}" in line and line.endswith("nothing was queued")


def test_a_refused_submission_leaves_nothing_behind(fake_slurm_bin, tmp_path, monkeypatch):
    refuse = 'echo "sbatch: error: Batch job submission failed: Invalid qos specification" >&2'
    (fake_slurm_bin.parent / "bin" / "sbatch").write_text(f"#!/bin/bash\n{refuse}\nexit 1\n")
    kept = tmp_path / "runs" / "digits" / "OLD" / "slurm" / "1_0_log.out"  # an earlier attempt
    kept.parent.mkdir(parents=True)
    kept.write_text("log")
    for name in ("NEW", "OLD"):
        r = req(gpus=0, run_name=name, src=str(tmp_path))
        with pytest.raises(UserError, match="Invalid qos specification; check QOS"):
            slurm.submit(r, "")
    assert not (tmp_path / "runs" / "digits" / "NEW").exists()
    assert [p.name for p in kept.parent.iterdir()] == ["1_0_log.out"]


def test_submit_prints_job_id_logs_and_run_dir(fake_slurm_bin, tmp_path, capsys):
    r = req(gpus=0, src=str(tmp_path))
    assert slurm.submit(r, "") == 0
    out = capsys.readouterr().out
    assert "submitted job 4242" in out
    assert f"run dir: {tmp_path}/runs/digits/RUN" in out
    assert f"{tmp_path}/runs/digits/RUN/slurm/4242_0_log.out" in out
    assert f"{tmp_path}/runs/digits/RUN/slurm/4242_0_log.err" in out  # the engine's log
    assert (
        "watch:   make status RUNS=runs/digits/RUN; make logs RUN=runs/digits/RUN FOLLOW=1\n" in out
    )
    assert "stop:    make cancel RUN=runs/digits/RUN  (a checkpoint, then the job ends)\n" in out


def test_array_of_seed_jobs_is_one_sbatch(fake_slurm_bin, tmp_path):
    reqs = [req(gpus=0, run_name=f"B-seed{i}", src=str(tmp_path)) for i in range(3)]
    jobs = slurm.submit_array(reqs, [""] * 3, tmp_path / "slurm", "B", {"WANDB_RUN_GROUP": "B"})
    assert [j.job_id for j in jobs] == ["4242_0", "4242_1", "4242_2"]
    pickled = submitit_utils.DelayedSubmission.load(tmp_path / "slurm" / "4242_2_submitted.pkl")
    assert pickled.function.environ == {"WANDB_RUN_GROUP": "B"}  # set in the task
    assert fake_slurm_bin.read_text().count("sbatch ") == 1
    assert "#SBATCH --array=0-2%3\n" in (tmp_path / "script.sh").read_text()


# ---------------------------------------------------------------- ending a task


@pytest.fixture
def task_env(monkeypatch, fake_slurm_bin):
    for k, v in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return fake_slurm_bin


def job() -> slurm.EngineJob:
    return slurm.EngineJob("digits", ["run.name=RUN"], "/src", max_requeues=3)


@pytest.fixture(autouse=True)
def warned_of_the_time_limit():
    """The engine stopped on SLURM's SIGUSR2, as in a preemption ahead of the time limit."""
    preempt.reset()
    preempt.request_stop("SIGUSR2")
    yield
    preempt.reset()


def test_done_returns_zero_and_requeues_nothing(task_env):
    assert job().finish(0) == 0
    assert not task_env.exists()


def test_a_failure_raises_so_submitit_records_it(task_env):
    with pytest.raises(RuntimeError, match="exited with code 2"):
        job().finish(2)
    assert not task_env.exists()


def test_preempted_rank0_requeues_and_leaves_with_75(task_env):
    with pytest.raises(SystemExit) as stop:
        job().finish(75)
    assert stop.value.code == 75
    assert task_env.read_text() == "scontrol requeue 4242\n"


def test_the_requeue_survives_the_signals_of_the_preemption_that_asked_for_it(task_env):
    """SLURM signals every process of the step, scontrol too: killed mid-request by the
    preemption's SIGTERM or a second SIGUSR2, it would leave the job FAILED, not requeued."""
    scontrol = Path(shutil.which("scontrol"))
    preempted = "#!/bin/bash\nkill -TERM $$; kill -USR2 $$\n"  # as the fake starts
    scontrol.write_text(scontrol.read_text().replace("#!/bin/bash\n", preempted, 1))
    with pytest.raises(SystemExit) as stop:
        job().finish(75)
    assert stop.value.code == 75
    assert task_env.read_text() == "scontrol requeue 4242\n"
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # the handlers are back


def test_preempted_array_task_requeues_its_own_task(task_env, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "100")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    with pytest.raises(SystemExit):
        job().finish(75)
    assert task_env.read_text() == "scontrol requeue 100_3\n"


def test_preempted_other_ranks_leave_without_requeueing(task_env, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "1")
    with pytest.raises(SystemExit) as stop:
        job().finish(75)
    assert stop.value.code == 75 and not task_env.exists()


def test_requeues_stop_at_the_limit(task_env, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    with pytest.raises(RuntimeError, match="requeued 3 times"):
        job().finish(75)
    assert not task_env.exists()


# ------------------------------------------- through submitit's own entry point (process_job)

FAKE_TRAIN = """\
import os, signal
from pathlib import Path

from engine import preempt  # the engine's real handlers: a flag only


def main(argv):
    Path("engine-argv.txt").write_text("\\n".join(argv))
    if os.environ["SIGNAL_AT"] == "setup":  # before the engine's handler exists
        os.kill(os.getpid(), signal.SIGUSR2)
    preempt.install_handlers()
    os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))
    Path("engine-saw-flag.txt").write_text(str(len(preempt.received())))
    return 75 if preempt.stop_requested() else 0
"""


def run_process_job(tmp_path: Path, fake_slurm_bin: Path, signal_at: str, sig: str = "SIGUSR2"):
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "launch", checkout / "launch", ignore=shutil.ignore_patterns("__py*"))
    copy_torch_free_engine(checkout)
    (checkout / "engine" / "cli.py").write_text(FAKE_TRAIN)
    folder = tmp_path / "slurm"
    folder.mkdir()
    delayed = submitit_utils.DelayedSubmission(
        slurm.EngineJob("digits", ["run.name=RUN"], str(checkout), max_requeues=3)
    )
    delayed.set_timeout(60, 3)
    delayed.dump(folder / "4242_submitted.pkl")
    env = {
        **os.environ,
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
        "SIGNAL_AT": signal_at,
        "SIGNAL": sig,
    }
    done = subprocess.run(
        [sys.executable, "-m", "submitit.core._submit", str(folder)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return checkout, folder, done


def test_engine_handler_runs_and_launch_requeues_through_process_job(tmp_path, fake_slurm_bin):
    checkout, folder, done = run_process_job(tmp_path, fake_slurm_bin, "training")
    assert done.returncode == 75, done.stderr
    assert (checkout / "engine-argv.txt").read_text() == "digits\nrun.name=RUN"
    assert (checkout / "engine-saw-flag.txt").read_text() == "1"
    assert fake_slurm_bin.read_text() == "scontrol requeue 4242\n"
    assert "Caught signal" not in done.stderr  # submitit's handler never ran
    assert not list(folder.glob("*_result.pkl"))  # the job is not over for submitit


def test_a_sigterm_alone_stops_with_75_and_requeues_nothing(tmp_path, fake_slurm_bin):
    """scancel sends SIGTERM: the engine saves and stops, and the job must stay cancelled."""
    checkout, folder, done = run_process_job(tmp_path, fake_slurm_bin, "training", "SIGTERM")
    assert done.returncode == 75, done.stderr
    assert (checkout / "engine-saw-flag.txt").read_text() == "1"
    assert not fake_slurm_bin.exists()


def test_a_signal_before_the_engine_handler_meets_submitit_which_requeues_the_same_call(
    tmp_path, fake_slurm_bin
):
    checkout, folder, done = run_process_job(tmp_path, fake_slurm_bin, "setup")
    assert done.returncode != 0 and "Caught signal SIGUSR2" in done.stderr
    assert fake_slurm_bin.read_text() == "scontrol requeue 4242\n"
    assert not (checkout / "engine-saw-flag.txt").exists()
    again = submitit_utils.DelayedSubmission.load(folder / "4242_submitted.pkl")
    assert isinstance(again.function, slurm.EngineJob)
    assert (again.function.recipe, again.function.args) == ("digits", ["run.name=RUN"])


def test_launch_slurm_options_are_the_engine_slurm_section():
    """One schema: launch's frozen Slurm carries exactly the engine's `slurm:` keys and
    defaults, apart from the resources that become the request's GPUS and NODES."""
    engine = {f.name: getattr(SlurmConfig(), f.name) for f in dataclasses.fields(SlurmConfig)}
    engine = {k: v for k, v in engine.items() if k not in request.RESOURCES}
    launch = {f.name: getattr(Slurm(), f.name) for f in dataclasses.fields(Slurm)}
    assert launch == engine | {"setup": tuple(engine["setup"])}
