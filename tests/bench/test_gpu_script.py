"""The one-shot GPU benchmark (bench/gpu.sh) in its smoke mode: every measurement runs with
tiny sizes (on the CPU here) in an interpreter where wandb, submitit, matplotlib and
safetensors cannot be imported, as on a GPU machine with only torch and torchvision, and
leaves one JSON file with the versions and an entry for each part (ok, or skipped with the
reason where CUDA is needed); a part that overruns the budget (planted) is stopped by the
watchdog with the parts before it kept. Also: the default plan's margin and the 8 minutes of
the whole script, --only's names, the wheels bench/gpu.sh installs, and the gpt block's
budget share and out-of-memory record without running it."""

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.engine_runs import BREAKDOWN, has_key
from bench.gpu.sizes import (
    BUDGET_S,
    MARGIN,
    PARTS,
    SMOKE,
    TESTS_S,
    WATCHDOG_GRACE_S,
    Sizes,
    selectable,
)
from tests.datagen_cifar import write_cifar_batches

REPO = Path(__file__).resolve().parent.parent.parent
SCRIPT = REPO / "bench" / "gpu.sh"
MEASUREMENTS = [
    "resnet50_synthetic",
    "imagenet_jpeg",
    "decode_stages",
    "cifar10_fast",
    "compile_recompiles",
    "determinism",
    "gpt",
    "tensor_parallel",
    "memory_and_mfu",
]
NEEDS_CUDA = {"cifar10_fast.airbench94"}  # skipped on a CPU, with the reason
BLOCKED = ("wandb", "submitit", "matplotlib", "safetensors")


def without_wandb_and_submitit(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine with torch and torchvision only: BLOCKED cannot be
    imported (sys.modules[name] = None in a sitecustomize)."""
    site = tmp_path / "site"
    site.mkdir()
    lines = ["import sys", *(f"sys.modules[{name!r}] = None" for name in BLOCKED)]
    (site / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "WANDB_API_KEY", "GPU_BENCH_BUDGET_S")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return env | {
        "PYTHONPATH": str(site),
        "GPU_BENCH_PYTHON": sys.executable,
        "GPU_BENCH_WHEELS": str(tmp_path / "no-wheels"),  # not the checkout's .gpu-wheels
        "OMP_NUM_THREADS": "1",
    }


def part_entry(measurements: dict, key: str) -> dict:
    """The entry filed under measurements.<key>, a dotted name."""
    entry = measurements
    for step in key.split("."):
        entry = entry[step]
    return entry


def test_wrapper_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_default_plan_leaves_a_margin_of_the_budget():
    sizes = Sizes()
    planned = sum(seconds for _, seconds in sizes.planned_s)
    assert planned <= MARGIN * BUDGET_S, (planned, BUDGET_S)
    assert dict(sizes.planned_s)["gpt"] == sizes.gpt_share_s
    assert [name for name, _ in sizes.planned_s] == MEASUREMENTS[:-1]  # (e) only gathers


def test_the_whole_script_fits_8_minutes_of_one_gpu():
    """The benchmark's budget, the watchdog's grace and the GPU tests' timeout in gpu.sh."""
    assert BUDGET_S + WATCHDOG_GRACE_S + TESTS_S <= 8 * 60
    assert f"timeout {TESTS_S} " in SCRIPT.read_text()
    assert f"default {BUDGET_S:.0f})" in SCRIPT.read_text()


def test_only_takes_parts_and_refuses_an_unknown_name_with_the_valid_ones(capsys):
    from bench.gpu.__main__ import parse_args

    args = parse_args(["--smoke", "--only", "resnet50_synthetic.eager,gpt.speed.compiled"])
    assert args.only == "resnet50_synthetic.eager,gpt.speed.compiled"
    with pytest.raises(SystemExit) as stop:
        parse_args(["--smoke", "--only", "gpt.speed.compild"])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown gpt.speed.compild" in error
    assert "resnet50_synthetic.eager" in error and "gpt.speed.compiled" in error


def test_only_runs_the_named_parts_the_groups_above_and_below(tmp_path):
    import shutil

    import torch

    from bench.gpu.harness import Bench
    from bench.gpu.sizes import SMOKE

    args = argparse.Namespace(smoke=True, budget=300.0, only="resnet50_synthetic.eager,gpt.memory")
    bench = Bench(args, SMOKE, torch.device("cpu"), tmp_path / "gpu.json")
    shutil.rmtree(bench.tmp, ignore_errors=True)
    chosen = {name for name in selectable() if bench.selected(name)}
    assert chosen == {
        "resnet50_synthetic",
        "resnet50_synthetic.eager",
        "gpt",
        "gpt.memory",
        "gpt.memory.checkpointing",
        "gpt.memory.no_checkpointing",
    }
    with pytest.raises(ValueError, match="not in bench.gpu.sizes.PARTS"):
        bench.selected("gpt.speed.fused")


def fake_airbench_wheel(folder: Path) -> Path:
    """A minimal wheel of a package named airbench (an empty module), as pip installs it."""
    import zipfile

    wheel = folder / "airbench-0.1.8-py3-none-any.whl"
    info = "airbench-0.1.8.dist-info"
    files = {
        "airbench/__init__.py": "",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: airbench\nVersion: 0.1.8\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def fake_airbench_sdist(folder: Path) -> Path:
    import tarfile

    source = folder / "src" / "airbench-0.1.8" / "airbench"
    source.mkdir(parents=True)
    (source / "__init__.py").write_text("")
    sdist = folder / "airbench-0.1.8.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(source.parent, arcname="airbench-0.1.8")
    return sdist


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_gpu_sh_installs_a_wheel_or_unpacks_an_sdist_from_the_wheels_folder(tmp_path, kind):
    """A wheel in GPU_BENCH_WHEELS is pip-installed (--no-deps) and an sdist unpacked onto
    PYTHONPATH before the benchmark: the package then imports, and no line says it is
    missing (the smoke run, without it, checks that line)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    if kind == "wheel":
        fake_airbench_wheel(wheels)
    else:
        fake_airbench_sdist(tmp_path).rename(wheels / "airbench-0.1.8.tar.gz")
    env = without_wandb_and_submitit(tmp_path) | {
        "GPU_BENCH_WHEELS": str(wheels),
        "GPU_BENCH_TESTS": "0",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gpu.sh: airbench (cifar10_fast.airbench94) is missing" not in done.stdout
    assert "could not install" not in done.stdout, done.stdout


@pytest.mark.slow
def test_smoke_run_writes_every_measurement_without_wandb_or_submitit(tmp_path):
    env = without_wandb_and_submitit(tmp_path)
    for name in BLOCKED:
        blocked = subprocess.run(
            [sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True
        )
        assert blocked.returncode != 0 and f"import of {name} halted" in blocked.stderr
    # CIFAR-10 files where the recipe looks for them: the run-to-the-end path runs too
    write_cifar_batches(tmp_path / "data" / "cifar10", 1024, 256, python2=False)
    out = tmp_path / "out"
    env |= {"OUT": str(out), "RECIPES_DATA": str(tmp_path / "data")}
    done = subprocess.run(
        ["bash", str(SCRIPT), "--smoke"],
        cwd=tmp_path,  # the wrapper finds the repository itself
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = out / "gpu.json"
    assert f"results in {path}" in done.stdout
    result = json.loads(path.read_text())

    assert result["mode"] == "smoke" and result["finished_utc"]
    versions = result["versions"]
    for key in ("python", "torch", "torchvision", "cuda", "cudnn", "git_sha"):
        assert key in versions, key
    assert versions["torch"].split("+")[0] in done.stdout + json.dumps(versions)
    # no CUDA here: the wrapper reads that from the results and runs no GPU tests
    assert versions["cuda_available"] is False and "GPU tests" not in done.stdout

    m = result["measurements"]
    assert list(m) == MEASUREMENTS
    assert "aborted" not in result
    for key in parts_that_run_on_a_cpu():  # each part filed under its dotted name, and ran
        entry = part_entry(m, key)
        assert entry["status"] == "ok", (key, entry)
    for key in NEEDS_CUDA:
        entry = part_entry(m, key)
        assert entry["status"] == "skipped" and "needs CUDA" in entry["reason"], (key, entry)
    assert "gpu.sh: airbench (cifar10_fast.airbench94) is missing" in done.stdout
    tp = m["tensor_parallel"]  # says why it did not run, in the JSON and the summary
    assert tp["status"] == "skipped" and "tp=2 against tp=1 needs two" in tp["reason"], tp
    assert "(g) tensor parallel: skipped (0 GPU(s) here" in done.stdout
    for name, entry in m.items():
        assert entry["status"] in ("ok", "error", "skipped", "not present"), name
        if entry["status"] == "error":
            assert entry["error"], name
        if entry["status"] in ("skipped", "not present"):
            assert entry["reason"], name

    # The smoke run exists to prove the code paths: here each of them must run.
    a = m["resnet50_synthetic"]
    assert a["status"] == "ok", a
    for mode in ("eager", "compiled"):
        assert a[mode]["status"] == "ok", a[mode]
        assert a[mode]["engine"]["img_per_s"] > 0 and a[mode]["bare"]["img_per_s"] > 0
        assert a[mode]["engine_over_bare"] > 0
    cpu = m["imagenet_jpeg"]["cpu_decode"]
    assert cpu["status"] == "ok", cpu
    assert cpu["img_per_s"] > 0 and 0 <= cpu["data_wait_fraction"] <= 1
    gpu = m["imagenet_jpeg"]["gpu_decode"]  # on a CPU the device decode runs on the CPU
    assert gpu["status"] == "ok" and gpu["img_per_s"] > 0, gpu
    check_jpeg_and_decode_stages(m)
    check_determinism(m["determinism"])
    c = m["cifar10_fast"]
    assert c["status"] == "ok", c
    fast = c["generated"]
    assert fast["epoch_s"] > 0 and fast["projected_budget_s"] > fast["epoch_s"]
    real = c["real_data"]
    assert real["status"] == "ok" and real["steps"] == 6 and 0 <= real["top1"] <= 1, real
    d = m["compile_recompiles"]
    assert d["status"] == "ok", d
    assert d["frames_compiled"] >= 1 and d["recompiles"] >= 0 and len(d["phases"]) == 5
    rows = m["memory_and_mfu"]["rows"]
    assert m["memory_and_mfu"]["status"] == "ok" and rows

    # (f) gpt: config.yaml's model in smoke mode, every part run, with numbers
    f = m["gpt"]
    assert f["status"] == "ok", f
    speed, memory = f["speed"], f["memory"]
    for part in (speed, memory):
        assert part["variant"] == "config" and part["parameters"] > 0, part
        assert part["flops_per_token"] > 0 and part["tokens_per_step"] > 0
    for key in ("eager", "eager_checkpointing", "compiled"):
        e = speed[key]
        assert e["status"] == "ok", (key, e)
        assert e["tokens_per_s"] > 0 and e["step_ms"] > 0 and e["timed_steps"] >= 2, e
        assert math.isfinite(e["last_loss"]) and "mfu" in e and "peak_step_gib" in e
    assert speed["eager_checkpointing"]["activation_checkpointing"] is True
    assert speed["compiled"]["compiled"] is True
    assert speed["compiled"]["torch_compile"]["frames_compiled"] >= 1
    from recipes.gpt import memory as gpt_memory

    plan = dataclasses.replace(
        gpt_memory.load("config"), micro_batch=memory["micro_batch"], seq_len=memory["seq_len"]
    )
    expected = gpt_memory.estimate(plan, gpus=1)["ddp"]  # the script's estimate is memory.py's
    assert memory["estimate_gib"] == {k: round(v / 2**30, 3) for k, v in expected.items()}
    for key, total in (("checkpointing", "total_ckpt"), ("no_checkpointing", "total")):
        e = memory[key]
        assert e["status"] == "ok", (key, e)
        assert e["tokens_per_s"] > 0 and e["estimate_gib"] == memory["estimate_gib"][total]
        assert e["activation_checkpointing"] is (key == "checkpointing")
    assert f["headline"]["tokens_per_s"] > 0
    for factor in (2, 4):
        e = f["micro_batch"][f"x{factor}"]
        assert e["status"] == "ok" and e["micro_batch"] == factor * speed["micro_batch"], e
        assert e["tokens_per_s"] > 0 and e["compiled"] is False and "mfu" in e, e
    assert {r["measurement"] for r in rows} >= {
        "gpt.speed.eager",
        "gpt.speed.eager_checkpointing",
        "gpt.speed.compiled",
        "gpt.memory.checkpointing",
        "gpt.memory.no_checkpointing",
    }


def parts_that_run_on_a_cpu() -> list[str]:
    """Every part's dotted name but those that need CUDA, the decode_stages runs the smoke's
    sizes leave out, and the decode split where this checkout's config lacks
    data.cpu_decode_share."""
    keys = [f"{name}.{part}" for name, parts in PARTS.items() for part in parts]
    split = has_key("imagenet", "data.cpu_decode_share")
    made = {f"decode_stages.{run}" for run in SMOKE.stage_runs}
    engine_runs = ("decode_stages.engine.", "decode_stages.split.")
    return [
        k
        for k in keys
        if k not in NEEDS_CUDA
        and (split or ".split." not in k)
        and (not k.startswith(engine_runs) or k in made)
        and (k != "determinism.compiled" or SMOKE.determinism_compiled)
        and not k.startswith("tensor_parallel.")  # two GPUs
    ]


def check_breakdown(entry: dict) -> None:
    """Every breakdown field of the engine's train records, as a share of the wall time."""
    shares = entry["breakdown"]
    assert set(shares) == set(BREAKDOWN), shares
    assert all(share >= 0 for share in shares.values()) and shares["data_wait"] <= 1, shares
    assert shares["step_host"] > 0, shares


def check_jpeg_and_decode_stages(m: dict) -> None:
    folder = m["imagenet_jpeg"]["folder"]
    assert folder["generation_s"] > 0 and folder["unique_train_files"] >= 16, folder
    for decode in ("cpu_decode", "gpu_decode"):
        e = m["imagenet_jpeg"][decode]
        check_breakdown(e)
        assert e["eval_images"] == folder["val_files"] > 0 and e["eval_s"] > 0, e
    assert m["imagenet_jpeg"]["gpu_decode"]["breakdown"]["decode"] > 0  # on the CPU here
    stages = m["decode_stages"]
    assert stages["status"] == "ok", stages
    for part in ("decode", "augment", "finish_thread"):
        assert stages[part]["img_per_s"] > 0 and stages[part]["timed_images"] > 0, stages[part]
    assert stages["finish_thread"]["thread_busy_share"] > 0
    e = stages["engine"]["ahead3_most_cores"]  # smoke: one engine run and one split
    assert e["decode_ahead"] == 3 and e["loader_workers"] >= 1 and e["img_per_s"] > 0
    check_breakdown(e)
    for part in ("ahead1_half_cores", "ahead3_half_cores", "ahead1_most_cores"):
        assert stages["engine"][part]["status"] == "skipped", stages["engine"][part]
    assert stages["split"]["gpu_only"]["status"] == "skipped"
    split = stages["split"]["cpu_quarter"]
    if has_key("imagenet", "data.cpu_decode_share"):
        assert split["status"] == "ok" and split["img_per_s"] > 0, split
    else:
        assert "cpu_decode_share" in split["reason"]


def check_determinism(entry: dict) -> None:
    """On a CPU, with deterministic=true, runs and a stop/resume give the same weights (the
    smoke's sizes make the eager runs only)."""
    assert entry["status"] == "ok", entry
    e = entry["eager"]
    assert e["status"] == "ok" and e["compiled"] is False, e
    for comparison in ("two_runs", "stop_resume"):
        assert e[comparison] == {"equal": True, "max_abs_diff": 0.0}, e
    assert e["flags"]["algorithms"] is True
    assert entry["compiled"]["status"] == "skipped" and "eager only" in entry["compiled"]["reason"]


STALLS = [  # (the part that stalls, --only, the parts measured before it)
    ("resnet50_synthetic.compiled", "", ["resnet50_synthetic.eager"]),
    (
        "gpt.speed.compiled",
        "gpt,memory_and_mfu",
        [
            "gpt.speed.eager",
            "gpt.speed.eager_checkpointing",
            "gpt.micro_batch.x2",
            "gpt.micro_batch.x4",
            "gpt.memory.checkpointing",
            "gpt.memory.no_checkpointing",
        ],
    ),
]


@pytest.mark.slow
def test_the_watchdog_keeps_the_parts_measured_before_a_stall(tmp_path):
    """A planted stall overruns the budget: the watchdog marks that part and its measurement
    aborted, keeps the parts that ended (with their figures) and marks the rest not reached.
    Both stalls run at once: each run spends most of its time waiting out the grace."""
    started = []
    for i, (stall, only, _) in enumerate(STALLS):
        (tmp_path / str(i)).mkdir()
        env = without_wandb_and_submitit(tmp_path / str(i))
        out = tmp_path / str(i) / "out"
        env |= {"OUT": str(out), "GPU_BENCH_PLANT_STALL": stall}
        argv = ["bash", str(SCRIPT), "--smoke", "--budget", "120"]
        proc = subprocess.Popen(
            [*argv, *(["--only", only] if only else [])],
            cwd=tmp_path / str(i),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a failed check stops the run's whole process group
        )
        started.append((proc, out))
    try:
        for (proc, out), stall_case in zip(started, STALLS, strict=True):
            check_stalled_run(proc, out, *stall_case)
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


def check_stalled_run(proc: subprocess.Popen, out: Path, stall: str, only: str, kept: list):
    """The checks of one stalled run, as it left its output."""
    stdout, stderr = proc.communicate(timeout=150)
    assert proc.returncode == 0, (stall, stdout[-3000:] + stderr[-3000:])
    assert f"over the budget during {stall}" in stdout
    result = json.loads((out / "gpu.json").read_text())
    assert result["aborted"] == stall and result["finished_utc"]
    m = result["measurements"]
    assert list(m) == MEASUREMENTS
    measurement = stall.split(".")[0]
    assert m[measurement]["status"] == "aborted" and stall in m[measurement]["reason"]
    assert part_entry(m, stall)["status"] == "aborted"
    for key in kept:
        entry = part_entry(m, key)
        assert entry["status"] == "ok" and entry["seconds"] > 0, (key, entry)
        figure = entry.get("engine", {}).get("img_per_s") or entry.get("tokens_per_s")
        assert figure > 0, (key, entry)
    after = MEASUREMENTS[MEASUREMENTS.index(measurement) + 1 :]
    for name in MEASUREMENTS:
        if name in after:
            assert m[name] == {"status": "skipped", "reason": "not reached: over the budget"}
        elif name != measurement:
            assert m[name]["status"] == "skipped" and "--only" in m[name]["reason"], name


@pytest.fixture
def small_bench(tmp_path):
    """bench.gpu.gpt and a smoke-sized Bench on the CPU, its sizes replaced as asked."""
    import shutil

    import torch

    from bench.gpu import gpt
    from bench.gpu.harness import Bench
    from bench.gpu.sizes import SMOKE

    made = []

    def make(**sizes):
        args = argparse.Namespace(smoke=True, budget=300.0, only="gpt")
        sizes = dataclasses.replace(SMOKE, **sizes)
        made.append(Bench(args, sizes, torch.device("cpu"), tmp_path / "gpu.json"))
        return gpt, made[-1]

    yield make
    for bench in made:
        shutil.rmtree(bench.tmp, ignore_errors=True)


def test_gpt_parts_past_the_block_share_are_skipped_with_the_reason(small_bench):
    gpu, bench = small_bench(gpt_share_s=0.0)
    out = gpu.gpt_measure(bench)
    parts = [out["speed"][k] for k in ("eager", "eager_checkpointing", "compiled")]
    parts += [out["memory"][k] for k in ("checkpointing", "no_checkpointing")]
    for part in parts:
        assert part["status"] == "skipped" and "gpt block's 0 s" in part["reason"], part
    assert out["memory"]["estimate_gib"]["total"] > 0  # the estimate needs no device


def test_gpt_out_of_memory_is_recorded_next_to_the_estimate(small_bench, monkeypatch):
    import torch

    gpu, bench = small_bench()

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(gpu, "gpt_train", out_of_memory)
    plan = gpu.gpt_setup("config", 2, None)
    estimate = gpu.gpt_estimate(plan)
    entry = gpu.gpt_memory_part(bench, plan, False, estimate)
    assert entry["status"] == "out of memory" and "Tried to allocate" in entry["error"]
    assert entry["estimate_gib"] == estimate["total"]
    assert entry["activation_checkpointing"] is False


AIRBENCH_TABLE = """\
------------------------------------------------------------------------------------------
|  run     |  epoch  |  train_loss  |  train_acc  |  val_acc  |  tta_val_acc  |  total_time_seconds  |
------------------------------------------------------------------------------------------
|       0  |      0  |      0.1000  |     0.5000  |   0.6000  |               |              0.5000  |
|          |      1  |      0.1000  |     0.5000  |   0.6000  |               |              0.9000  |
|          |   eval  |              |             |           |       0.9400  |              1.1000  |
------------------------------------------------------------------------------------------
"""


def test_airbench_figures_are_read_from_the_table_it_prints():
    """airbench 0.1.8 prints its timing (cumulative, per epoch, then with the final
    evaluation) in a table: the training alone is the last epoch's, its own total the eval
    row's."""
    from bench.gpu.cifar10 import airbench_figures, airbench_rows

    figures = airbench_figures(airbench_rows(AIRBENCH_TABLE), steps=100)
    assert figures == {
        "airbench_total_s": 1.1,
        "train_s": 0.9,
        "step_ms": 9.0,
        "tta_val_acc": 0.94,
    }


def test_airbench_reads_the_generated_cifar10_in_its_own_format(small_bench):
    """cifar10/train.pt and test.pt as airbench's CifarLoader loads them: uint8 NHWC images,
    int64 labels, the ten class names; the same pixels the engine's run reads."""
    import torch

    from bench.gpu.cifar10 import airbench_files, cifar_folder
    from recipes.cifar10 import cifar_files

    _, bench = small_bench(cifar_train=64, cifar_test=32)
    folder = airbench_files(bench)
    train = torch.load(folder / "cifar10" / "train.pt", weights_only=True)
    test = torch.load(folder / "cifar10" / "test.pt", weights_only=True)
    assert train["images"].shape == (64, 32, 32, 3) and test["images"].shape == (32, 32, 32, 3)
    assert train["images"].dtype == torch.uint8 and train["labels"].dtype == torch.int64
    assert len(train["classes"]) == 10
    images, labels = cifar_files.read_split(cifar_folder(bench), True)
    assert torch.equal(train["images"].permute(0, 3, 1, 2), images)
    assert torch.equal(train["labels"], labels)
