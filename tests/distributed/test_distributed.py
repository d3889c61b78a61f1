"""Real multi-process training with gloo on CPU: torchrun, two torchrun agents as two nodes,
and the engine's own process spawning.

torchrun trains the reference run, restarts a killed group, joins two agents as two nodes and
ends a job whose rank failed; the tests whose subject is not the launcher start their ranks
with the engine's --spawn (spawn()), which runs the ranks' torchrun path with a store hosted by
the launcher as torchrun's agent does, from one import of torch instead of one per process
(test_spawned_and_profiled_processes_train_exactly_like_torchrun compares the two)."""

import json
import shutil
import subprocess
import sys

import pytest

from engine.meter import clocked
from engine.spawn import free_port
from launch.analysis import report
from tests.helpers import (
    QUIET,
    REPO,
    engine_env,
    final_weights,
    max_difference,
    records,
    run_dir,
    run_engine,
    same_weights,
    torchrun,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]
# GroupNorm has no batch statistics, so splitting a batch over processes changes nothing.
INVARIANT = ["model.norm=group", "train.max_steps=30", "log.sample_ids=true", "ckpt.every_steps=5"]
TOLERANCE = 1e-5  # float rounding from summing gradients in another order
# Resuming on another world size also changes the batch split for the remaining 13 steps;
# the rounding drift through SGD momentum reached 1.3e-5 on some hosts (same on older code).
RESUME_TOLERANCE = 5e-5


def spawn(n: int) -> list[str]:
    return [sys.executable, "-m", "engine.train", "--spawn", str(n)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def two_procs(root):
    run_engine(root, "two", *INVARIANT, prefix=torchrun(2))
    return final_weights(root, "two")


def sample_ids(root, name):
    lines = (run_dir(root, name) / "samples.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_one_process_with_accumulation_equals_two_processes(root, two_procs):
    run_engine(root, "one", *INVARIANT, "train.micro_batch_size=32")  # 2 accumulation steps
    assert sample_ids(root, "one") == sample_ids(root, "two")
    assert len(sample_ids(root, "one")) == 30
    assert max_difference(final_weights(root, "one"), two_procs) < TOLERANCE
    assert json.loads((run_dir(root, "two") / "env.json").read_text())["world_size"] == 2


def test_accumulation_on_two_processes_equals_one_process(root, two_procs):
    """2 processes x 2 micro batches against 1 process x 4: the global batch decides."""
    run_engine(root, "one-x4", *INVARIANT, "train.micro_batch_size=16")
    run_engine(root, "two-x2", *INVARIANT, "train.micro_batch_size=16", prefix=spawn(2))
    assert sample_ids(root, "one-x4") == sample_ids(root, "two-x2") == sample_ids(root, "two")
    # Four partial sums added in another order each step: the drift through momentum reached
    # 1.3e-5 after 30 steps; an unsynchronised micro batch moves the weights by ~1e-2.
    two_by_two = final_weights(root, "two-x2")
    assert max_difference(two_by_two, final_weights(root, "one-x4")) < RESUME_TOLERANCE
    assert max_difference(two_by_two, two_procs) < RESUME_TOLERANCE


def test_a_killed_worker_restarts_the_group_which_resumes_bitwise(root, two_procs):
    restarts = [*torchrun(2)]
    restarts.insert(restarts.index("-m", 3), "--max-restarts=1")
    # Rank 1 is SIGKILLed after step 12 in the first attempt only; the last checkpoint is 10.
    out = run_engine(
        root, "restarted", *INVARIANT, "fault.signal_at_step=12", "fault.rank=1", prefix=restarts
    )
    assert "resuming from" in out.stderr and "step 10)" in out.stderr
    assert same_weights(final_weights(root, "restarted"), two_procs)


def test_a_hung_rank_ends_the_job_with_a_timeout_naming_what_waited(tmp_path):
    # A silent hang would exceed the subprocess timeout and fail the test.
    out = run_engine(
        tmp_path,
        "hung",
        "train.max_steps=20",
        "log.every_steps=1",
        "fault.hang_at_step=3",
        "fault.rank=1",
        "dist.timeout_s=5",
        prefix=spawn(2),
        check=False,
        timeout=180,
    )
    assert out.returncode != 0
    assert "rank 0: no answer from the other ranks within dist.timeout_s=5s after step 3" in (
        out.stderr
    ), out.stderr[-3000:]


def test_spawned_and_profiled_processes_train_exactly_like_torchrun(root, two_procs):
    """The engine's own spawning trains as torchrun does, and profiling steps 4-6 on both
    ranks (prof.steps) changes no loss and no weight: one trace per rank, which parses and
    holds those steps, and make report's table of it."""
    profiled = ["prof.steps=4:6", "prof.ranks=all"]
    run_engine(root, "spawned", *INVARIANT, *profiled, prefix=spawn(2))
    assert same_weights(final_weights(root, "spawned"), two_procs)
    losses = [{k: v for k, v in r.items() if not clocked(k)} for r in records(root, "two", "train")]
    assert losses == [
        {k: v for k, v in r.items() if not clocked(k)} for r in records(root, "spawned", "train")
    ]
    folder = run_dir(root, "spawned") / "profile"
    for rank in (0, 1):
        trace = json.loads((folder / f"rank{rank}-steps4-6.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"step 4", "step 5", "step 6", "forward", "backward", "optimizer"} <= names
        assert "step 3" not in names and "step 7" not in names  # step 3 is the warm-up
        # torch.profiler's schedule: one ProfilerStep#N per recorded step, as HTA reads them
        iterations = [
            e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")
        ]
        assert sorted(e["name"] for e in iterations) == [f"ProfilerStep#{n}" for n in (1, 2, 3)]
        summary = json.loads((folder / f"rank{rank}-steps4-6.summary.json").read_text())
        assert summary["steps"] == [4, 6] and summary["top_ops"] and summary["steps_ms"] > 0
        assert summary["phases"]["forward"]["calls"] == 3
    found = report.read_runs([str(run_dir(root, "spawned"))])
    (row0, row1) = [
        line for line in report.markdown(found, None, "top1").splitlines() if "4-6 |" in line
    ]
    assert row0.startswith("| spawned | 0, 4-6 |") and row1.startswith("| spawned | 1, 4-6 |")


def test_compiled_ddp_trains_like_eager_ddp(tmp_path):
    """torch.compile(DDP(model)): dynamo's DDPOptimizer splits the graph at DDP's buckets;
    the losses and weights match the eager run up to float rounding (inductor fuses ops)."""
    common = ["train.max_steps=6", "log.every_steps=2"]
    for mode in ("on", "off"):
        run_engine(tmp_path, mode, *common, f"train.compile={mode}", prefix=spawn(2), timeout=600)
    compiled, eager = ([r["loss"] for r in records(tmp_path, m, "train")] for m in ("on", "off"))
    assert len(compiled) == 3 and compiled == pytest.approx(eager, abs=1e-4)
    assert max_difference(final_weights(tmp_path, "on"), final_weights(tmp_path, "off")) < 1e-4


def test_two_process_checkpoint_resumes_on_two_bitwise_and_on_one(root, two_procs):
    out = run_engine(root, "resume2", *INVARIANT, "train.stop_at_step=17", prefix=spawn(2))
    assert "stopped at step 17" in out.stderr
    # The same stopped run, resumed once on two processes and once on one.
    shutil.copytree(run_dir(root, "resume2"), run_dir(root, "resume1"))
    run_engine(root, "resume2", *INVARIANT, prefix=spawn(2))
    assert same_weights(final_weights(root, "resume2"), two_procs)
    out = run_engine(root, "resume1", *INVARIANT)
    assert "resuming from" in out.stderr
    assert sample_ids(root, "resume1") == sample_ids(root, "two")  # same samples, same steps
    assert max_difference(final_weights(root, "resume1"), two_procs) < RESUME_TOLERANCE


@pytest.mark.parametrize("world", [1, 2, 3])
def test_evaluation_sees_each_sample_exactly_once(tmp_path, world):
    run_engine(
        tmp_path,
        "eval",
        "train.max_steps=2",
        "train.batch_size=48",
        "eval.batch_size=50",
        "log.sample_ids=true",
        prefix=spawn(world) if world > 1 else None,
    )
    (record,) = records(tmp_path, "eval", "eval")
    assert record["count"] == 359  # the held-out split, once, whatever the world size
    (seen,) = map(json.loads, (run_dir(tmp_path, "eval") / "eval_samples.jsonl").open())
    by_rank = [set(ids) for ids in seen["ids_by_rank"]]
    assert len(by_rank) == world and all(by_rank)  # every rank took a share
    assert sum(map(len, by_rank)) == 359 and set().union(*by_rank) == set(range(359))


def test_two_torchrun_agents_as_two_nodes_form_one_job(tmp_path):
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        "--rdzv_id=two-nodes",
        "-m",
        "engine.train",
        "digits",
        *QUIET,
        f"run.root={tmp_path}",
        "run.name=nodes",
        "train.max_steps=3",
    ]
    procs = [
        subprocess.Popen(
            agent,
            cwd=REPO,
            env=engine_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    summary = json.loads((run_dir(tmp_path, "nodes") / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_one_failing_rank_ends_the_job_with_its_error(tmp_path, launcher):
    prefix = torchrun(2) if launcher == "torchrun" else spawn(2)
    # a hang would exceed the subprocess timeout and fail the test; no clock assertion needed
    out = run_engine(
        tmp_path,
        "fault",
        "fault.rank=1",
        "fault.raise_at_step=3",
        "dist.timeout_s=60",
        prefix=prefix,
        check=False,
        timeout=240,
    )
    assert out.returncode != 0
    assert "injected fault at step 3 on rank 1" in out.stdout + out.stderr


def test_dataparallel_strategy_saves_bare_weights(tmp_path):
    run_engine(tmp_path, "dp", "dist.strategy=dp", "train.max_steps=3")
    assert not any(k.startswith("module.") for k in final_weights(tmp_path, "dp"))


def test_sync_bn_on_cpu_is_a_clear_error(tmp_path):
    out = run_engine(
        tmp_path, "sbn", "dist.sync_bn=true", "train.max_steps=3", prefix=spawn(2), check=False
    )
    assert out.returncode != 0 and "error: dist.sync_bn needs CUDA devices" in out.stderr
    assert not run_dir(tmp_path, "sbn").exists()  # refused before anything was written


def test_make_train_with_two_cpu_processes_reaches_the_accuracy_bar(tmp_path):
    """...and resolves its request once: in launch's check, whose printed config the two
    ranks (and torchrun) read from the frozen file, resolving nothing themselves."""
    counted = tmp_path / "resolutions"
    args = f"run.root={tmp_path} run.name=make2 log.wandb=off optim.lr=0.2"
    env = engine_env(GPUS="0", PROCS="2", ARGS=args, RECIPES_RESOLUTIONS_LOG=str(counted))
    for var in ("RECIPE", "NODES", "DRY_RUN", "TARGET"):
        env.pop(var, None)
    out = subprocess.run(
        ["make", "train"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = run_dir(tmp_path, "make2")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["top1"] >= 0.98, summary
    (resolution,) = counted.read_text().splitlines()  # one, and not on a rank
    assert resolution.endswith(" rank=-"), resolution
    (frozen,) = (run / "request").iterdir()
    assert frozen.read_bytes() == (run / "config.yaml").read_bytes()
    assert "  lr: 0.2\n" in frozen.read_text()


@pytest.mark.parametrize("method", ["tcp", "file"])
def test_tcp_and_file_init_methods(tmp_path, method):
    init = f"tcp://127.0.0.1:{free_port()}" if method == "tcp" else f"file://{tmp_path}/rendezvous"
    counted = tmp_path / "resolutions"  # --spawn's children read the parent's resolution
    env = engine_env(RECIPES_RESOLUTIONS_LOG=str(counted))
    overrides = (f"dist.init_method={init}", "train.max_steps=3")
    run_engine(tmp_path, "init", *overrides, prefix=spawn(2), env=env)
    summary = json.loads((run_dir(tmp_path, "init") / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert len(counted.read_text().splitlines()) == 1
