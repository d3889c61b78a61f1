"""Optional packages never break training: a machine with torch and torchvision alone (a GPU
benchmark machine, a site image) lacks wandb, submitit, safetensors, matplotlib, scipy or
scikit-learn. Real processes in which a sitecustomize.py makes those modules unimportable
(`sys.modules[name] = None`, as tests/bench/test_gpu_script.py does; a forked warm process runs
it as an interpreter's start would, tests/warm.py): what needs none of them works; what needs
one is a single line naming the fix, with no traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.export import main as export_main
from tests import warm
from tests.helpers import REPO, engine_env, launch, records, run_dir, run_engine

WANDB_NOTE = (
    "note: log.wandb=auto: wandb is not installed, so W&B logging is off (pip install wandb, "
    "or set log.wandb=off to silence this)"
)


def without(tmp_path: Path, *modules: str) -> str:
    """A PYTHONPATH under which `modules` cannot be imported (the repository after it)."""
    site = tmp_path / f"without-{'-'.join(modules)}"
    site.mkdir()
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in modules)
    (site / "sitecustomize.py").write_text(f"import sys\n{blocked}")
    return f"{site}:{REPO}"


def env_without(tmp_path: Path, *modules: str, **extra: str) -> dict[str, str]:
    return engine_env(PYTHONPATH=without(tmp_path, *modules), **extra)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def python(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository with this environment, its output captured; a
    `-m MODULE` forked warm (tests/warm.py runs the sitecustomize that hides the modules)."""
    if args[0] == "-m" and warm.usable(env):
        return warm.run(args[1], list(args[2:]), env, REPO, timeout=120)
    command = [sys.executable, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_the_blocking_works(tmp_path):
    env = env_without(tmp_path, "wandb", "safetensors")
    for name in ("wandb", "safetensors"):
        done = subprocess.run(
            [sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True
        )
        assert done.returncode != 0 and "halted; None in sys.modules" in done.stderr


# ---------------------------------------------------------------- wandb


@pytest.mark.slow
def test_auto_without_wandb_trains_and_says_so_once_over_two_processes(tmp_path):
    """One process: test_local_launch_needs_neither_submitit_nor_wandb."""
    env = env_without(tmp_path, "wandb")
    steps = ["train.max_steps=3", "log.every_steps=1", "log.progress=off"]
    out = run_engine(tmp_path, "auto", "log.wandb=auto", *steps, "--spawn", "2", env=env)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines().count(WANDB_NOTE) == 1, out.stderr  # rank 0 only, once
    assert [r["step"] for r in records(tmp_path, "auto", "train")] == [1, 2, 3]
    assert records(tmp_path, "auto", "eval")
    folder = run_dir(tmp_path, "auto")
    assert (folder / "summary.json").exists() and not (folder / "wandb").exists()
    assert not (folder / "wandb-id.txt").exists()


@pytest.mark.slow
def test_off_without_wandb_says_nothing_about_it(tmp_path):
    out = run_engine(tmp_path, "off", "train.max_steps=1", env=env_without(tmp_path, "wandb"))
    assert "log.wandb=off" in out.args  # QUIET's
    assert "wandb is not installed" not in out.stderr and "W&B" not in out.stderr, out.stderr


def test_check_without_wandb_says_the_note(tmp_path):
    done = python(
        *"-m engine.train digits device=cpu --check 2".split(), env=env_without(tmp_path, "wandb")
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "config ok for 2 processes"
    assert error_lines(done.stderr) == [WANDB_NOTE]


@pytest.mark.parametrize(  # each mode once, each entry once: the check is the same code
    ("mode", "spawn"), [("offline", []), ("online", ["--spawn", "2"])], ids=["one", "spawn-2"]
)
def test_wandb_asked_for_without_wandb_is_one_line_before_anything_is_written(
    tmp_path, mode, spawn
):
    env = env_without(tmp_path, "wandb")
    out = run_engine(tmp_path, "asked", f"log.wandb={mode}", *spawn, env=env, check=False)
    assert out.returncode == 2, out.stderr
    assert error_lines(out.stderr) == [
        f"error: log.wandb={mode} but wandb is not installed: pip install wandb (the project's "
        "requirements.lock has it), or set log.wandb=off"
    ]
    assert not run_dir(tmp_path, "asked").exists()


def test_wandb_mode_offline_from_the_environment_without_wandb_is_one_line(tmp_path):
    env = env_without(tmp_path, "wandb", WANDB_MODE="offline")
    done = python("-m", "engine.train", "digits", "device=cpu", f"run.root={tmp_path}", env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = error_lines(done.stderr)
    assert line.startswith("error: log.wandb=offline but wandb is not installed")
    assert not (tmp_path / "digits").exists()


# ---------------------------------------------------------------- safetensors


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train_here) -> Path:
    """A run trained where every package is installed (in this process:
    tests/engine/conftest.py)."""
    root = tmp_path_factory.mktemp("runs")
    train_here(root, "w", "train.max_steps=2")
    return run_dir(root, "w")


def export(source: Path, out: Path, env: dict[str, str]):
    return python("-m", "engine.export", str(source), str(out), env=env)


@pytest.mark.slow
def test_export_without_safetensors_is_one_line_and_pt_still_works(tmp_path, trained):
    env = env_without(tmp_path, "safetensors")
    out = tmp_path / "exports" / "w.safetensors"
    done = export(trained, out, env)
    assert done.returncode == 2, done.stderr
    assert error_lines(done.stderr) == [
        "error: writing .safetensors needs the safetensors package, which is not installed: "
        "pip install safetensors (the project's requirements.lock has it), or export to .pt"
    ]
    assert not out.parent.exists() or not list(out.parent.iterdir())  # no file, no leftover

    done = export(trained, tmp_path / "w.pt", env)
    assert done.returncode == 0, done.stderr
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert weights and all(isinstance(t, torch.Tensor) for t in weights.values())


def test_scoring_a_safetensors_file_without_safetensors_is_one_line(tmp_path, trained):
    file = tmp_path / "w.safetensors"
    assert export_main([str(trained), str(file)]) == 0  # written where it is installed
    done = python(
        *"-m engine.train digits device=cpu --eval".split(),
        str(file),
        env=env_without(tmp_path, "safetensors"),
    )
    assert done.returncode == 2, done.stderr
    (line,) = error_lines(done.stderr)
    assert line.startswith(f"error: {file}: reading .safetensors needs the safetensors package")
    assert line.endswith("pip install safetensors (the project's requirements.lock has it)")
    assert not list(tmp_path.glob("*.eval.json"))


# ---------------------------------------------------------------- submitit


@pytest.mark.slow
def test_slurm_submission_without_submitit_is_one_line(tmp_path):
    pythonpath = without(tmp_path, "submitit")
    for args in (["submit", "--dry-run"], ["submit"], ["sweep", "--slurm", "--dry-run"]):
        done = launch(*args, "--gpus", "0", PYTHONPATH=pythonpath)
        assert done.returncode == 2, done.stderr
        (line,) = error_lines(done.stderr)
        assert line.startswith("launch: submitit is not installed here: pip install submitit")
        assert "make sbatch" in line


@pytest.mark.slow
def test_local_launch_needs_neither_submitit_nor_wandb(tmp_path):
    """Also the engine in one process under log.wandb=auto without wandb: it trains, says so
    once, and writes no W&B files."""
    pythonpath = without(tmp_path, "submitit", "wandb")
    config = launch("config", "--gpus", "0", PYTHONPATH=pythonpath)
    assert config.returncode == 0 and "Traceback" not in config.stderr, config.stderr
    assert "recipe: digits" in config.stdout
    overrides = [
        f"run.root={tmp_path}",
        "run.name=t",
        "log.wandb=auto",
        "train.max_steps=3",
        "log.every_steps=1",
        "log.progress=off",
    ]
    done = launch("train", "--gpus", "0", "--", *overrides, PYTHONPATH=pythonpath)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines().count(WANDB_NOTE) == 1, done.stderr
    assert [r["step"] for r in records(tmp_path, "t", "train")] == [1, 2, 3]
    assert records(tmp_path, "t", "eval")
    folder = run_dir(tmp_path, "t")
    assert json.loads((folder / "summary.json").read_text())
    assert not (folder / "wandb").exists() and not (folder / "wandb-id.txt").exists()


# ---------------------------------------------------------------- scipy


@pytest.mark.slow
def test_sweep_and_compare_without_scipy_are_one_line_before_anything_runs(tmp_path, trained):
    pythonpath = without(tmp_path, "scipy")
    args = f"run.root={tmp_path} run.name=s train.max_steps=2"
    dry = launch("sweep", "--gpus", "0", DRY_RUN="1", ARGS=args, PYTHONPATH=pythonpath)
    assert dry.returncode == 0 and "run.name=s-seed2" in dry.stdout  # a dry run needs no scipy
    for args_ in (["sweep", "--gpus", "0"], ["compare", str(trained)]):
        done = launch(*args_, ARGS=args, PYTHONPATH=pythonpath)
        assert done.returncode == 1, done.stderr
        (line,) = error_lines(done.stderr)
        assert line.startswith("launch: the comparison needs scipy, which is not installed here")
    assert not (tmp_path / "digits").exists()  # no member was started


# ---------------------------------------------------------------- matplotlib


def test_report_without_matplotlib_writes_the_table_and_says_why_no_chart(tmp_path, trained):
    done = launch("report", str(trained), PYTHONPATH=without(tmp_path, "matplotlib"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    (line,) = error_lines(done.stderr)
    assert line.startswith("launch: warning: no chart: the charts need matplotlib")
    assert "pip install matplotlib" in line
    md = trained.parent / "report-w.md"
    assert done.stdout.strip() == str(md)
    text = md.read_text()
    assert "| w | finished |" in text and "![" not in text


def test_bench_report_without_matplotlib_keeps_the_results(tmp_path):
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from bench.__main__ import write\n"
        "report = {'quick': True, 'date': 'd', 'host': 'h', 'cpu_count': 1, 'threads': 1, "
        "'torch_runtime': 't', 'results': []}\n"
        "paths = write(Path(sys.argv[1]), report)\n"
        "print(json.dumps([str(p) if p else None for p in paths]))\n"
    )
    done = python("-c", script, str(tmp_path), env=env_without(tmp_path, "matplotlib"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [str(tmp_path / "results.json"), None]
    (line,) = error_lines(done.stderr)
    assert line.startswith("warning: no chart: matplotlib is not installed (pip install")
    assert not (tmp_path / "chart.png").exists()


# ---------------------------------------------------------------- scikit-learn


@pytest.mark.slow
def test_digits_without_sklearn_is_one_line_before_anything_is_written(tmp_path):
    env = env_without(tmp_path, "sklearn")
    out = run_engine(tmp_path, "d", env=env, check=False)
    assert out.returncode == 2, out.stderr
    assert error_lines(out.stderr) == [
        "error: recipe digits reads the digits data that scikit-learn ships, and scikit-learn "
        "is not installed: pip install scikit-learn (the project's requirements.lock has it)"
    ]
    assert not run_dir(tmp_path, "d").exists()


def test_bench_jpegs_without_sklearn_is_one_line(tmp_path):
    done = python(
        "-m", "bench.jpegs", str(tmp_path / "jpegs"), env=env_without(tmp_path, "sklearn")
    )
    assert done.returncode == 1
    (line,) = error_lines(done.stderr)
    assert line.startswith("error: the JPEG folder is made from scikit-learn's sample")
    assert "pip install scikit-learn" in line
    assert not (tmp_path / "jpegs").exists()
