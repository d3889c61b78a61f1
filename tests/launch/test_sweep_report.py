"""launch.sweep: per-seed requests, report math on fake summaries, and a local sweep through
`python -m launch sweep` with a fake engine."""

import json
import statistics
import subprocess
from pathlib import Path

import pytest

from launch import sweep
from launch.errors import UserError
from launch.render import Request
from tests import helpers

ROOT = Path(__file__).resolve().parents[2]
TOP1 = [0.90, 0.92, 0.97]
TASK = {"headline": "top1", "higher_is_better": True, "unit": "samples"}  # as the engine writes


def summary(seed: int) -> dict:
    return {
        "top1": TOP1[seed % 3],
        "top5": 1.0,
        "eval_loss": 0.5 - 0.1 * seed,
        "seconds": 100.0 + 10 * seed,
        "steps": 450,
        "epochs": 15,
        "world_size": 2,
        "headline": "top1",
        "higher_is_better": True,
    }


def write_runs(parent: Path, base: str, seeds) -> dict[int, Path]:
    dirs = {}
    for seed in seeds:
        folder = parent / f"{base}-seed{seed}"
        folder.mkdir(parents=True)
        (folder / "env.json").write_text(json.dumps({"task": TASK}))
        (folder / "summary.json").write_text(json.dumps(summary(seed)))
        dirs[seed] = folder
    return dirs


def test_seed_requests_replace_the_users_seed_and_name():
    base = Request(recipe="digits", run_name="B", overrides=("seed=9", "a=1", "run.name=B"))
    reqs = sweep.seed_requests(base, 3)
    assert [r.run_name for r in reqs] == ["B-seed0", "B-seed1", "B-seed2"]
    assert [r.overrides for r in reqs] == [("a=1", f"seed={i}") for i in range(3)]


def test_mean_and_sample_std():
    stats = sweep.summarize({i: summary(i) for i in range(3)})
    assert stats["top1"]["mean"] == pytest.approx(0.93)
    assert stats["top1"]["std"] == pytest.approx(0.0360555, rel=1e-5)  # n - 1, not n
    assert stats["top1"]["std"] == pytest.approx(statistics.stdev(TOP1))
    assert stats["seconds"] == {"mean": 110.0, "std": 10.0, "n": 3}
    assert stats["world_size"] == {"mean": 2.0, "std": 0.0, "n": 3}
    assert list(stats)[:6] == ["top1", "top5", "eval_loss", "seconds", "steps", "world_size"]
    assert "epochs" in stats


def test_single_seed_has_no_std_and_non_numbers_are_left_out():
    stats = sweep.summarize({0: {"top1": 0.5, "note": "x", "flag": True}})
    assert stats == {"top1": {"mean": 0.5, "std": None, "n": 1}}


def test_report_files(tmp_path):
    runs = sweep.read_summaries(write_runs(tmp_path, "B", range(3)))
    text = sweep.write_report(tmp_path / "B-sweep", "digits", "B", runs)
    assert (tmp_path / "B-sweep" / "report.md").read_text() == text
    assert "| 0 | B-seed0 | 0.9000 |" in text
    assert "| mean ± std | | 0.9300 ± 0.0361 | 1.0000 ± 0.0000 |" in text
    assert "110.0 ± 10.0" in text and "sample standard deviation" in text
    assert "| 450 | 2 | 15 |" in text and "| 450.0 ± 0.0 | 2.0 ± 0.0 | 15.0 ± 0.0 |" in text
    data = json.loads((tmp_path / "B-sweep" / "report.json").read_text())
    assert data["seeds"] == [0, 1, 2]
    assert data["runs"]["2"] == {"run": "B-seed2", "summary": summary(2)}
    assert data["metrics"]["top1"]["mean"] == pytest.approx(0.93)


def test_a_missing_summary_is_an_error_naming_the_seed(tmp_path):
    dirs = write_runs(tmp_path, "B", [0])
    dirs[1] = tmp_path / "B-seed1"
    with pytest.raises(UserError, match="seed 1 has not finished") as err:
        sweep.read_summaries(dirs)
    assert err.value.code == 1


def test_existing_seeds_matches_only_this_base(tmp_path):
    write_runs(tmp_path, "B", [0, 2, 10])
    write_runs(tmp_path, "B-seed1x", [0])
    (tmp_path / "B-sweep").mkdir()
    assert sorted(sweep.existing_seeds(tmp_path, "B")) == [0, 2, 10]


# ---------------------------------------------------------------- through the CLI

FAKE_TRAIN = """\
import json, os, sys
from pathlib import Path

def main(argv):
    if "--check" in argv:  # launch's config check before the first seed
        return 0
    recipe, args = argv[0], dict(a.split("=", 1) for a in argv[1:])
    seed = int(args["seed"])
    run = Path("runs") / recipe / args["run.name"]
    run.mkdir(parents=True, exist_ok=True)
    task = {"headline": "top1", "higher_is_better": True, "unit": "samples"}
    (run / "env.json").write_text(json.dumps({"task": task}))
    if os.environ.get("FAIL_SEED") == str(seed):
        return 1
    summary = {"top1": 0.9 + 0.01 * seed, "top5": 1.0, "eval_loss": 0.1, "seconds": 1.0,
               "steps": 10, "world_size": 1, "device": args.get("device"),
               "group": os.environ.get("WANDB_RUN_GROUP"),
               "headline": "top1", "higher_is_better": True}
    (run / "summary.json").write_text(json.dumps(summary))
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def checkout(tmp_path):
    return helpers.fake_checkout(tmp_path / "checkout", FAKE_TRAIN, "seed: 0\n")


def launch_sweep(checkout: Path, *args, **env) -> subprocess.CompletedProcess:
    return helpers.launch("sweep", *args, cwd=checkout, timeout=120, **{"GPUS": "0", **env})


def test_local_sweep_runs_each_seed_and_reports(checkout):
    done = launch_sweep(checkout, "--seeds", "3", ARGS="run.name=base optim.lr=0.1")
    assert done.returncode == 0, done.stderr
    folder = checkout / "runs" / "digits" / "base-sweep"
    assert done.stdout == (folder / "report.md").read_text()
    assert "| 2 | base-seed2 | 0.9200 |" in done.stdout
    assert "0.9100 ± 0.0100" in done.stdout
    data = json.loads((folder / "report.json").read_text())
    assert data["runs"]["1"]["summary"]["device"] == "cpu"
    assert data["runs"]["1"]["summary"]["group"] == "base"  # one W&B group per sweep
    assert done.stderr.count("+ ") == 3


def test_sweep_dry_run_prints_one_command_per_seed(checkout):
    done = launch_sweep(checkout, DRY_RUN="1", SEEDS="2", ARGS="run.name=b seed=7")
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert lines[1].endswith("engine.train digits device=cpu run.name=b-seed1 seed=1")
    assert not (checkout / "runs").exists()


def test_slurm_sweep_dry_run_prints_the_one_array_it_submits():
    done = launch_sweep(ROOT, DRY_RUN="1", SEEDS="2", TARGET="submit", ARGS="run.name=b")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("#!/bin/bash\n") == 1 and "#SBATCH --array=0-1%2\n" in done.stdout
    assert "#SBATCH --job-name=b\n" in done.stdout
    tasks = [line for line in done.stdout.splitlines() if line.startswith("#   array task ")]
    assert [t.endswith(f"run.name=b-seed{i} seed={i}") for i, t in enumerate(tasks)] == [True] * 2
    assert not (ROOT / "runs" / "digits" / "b-sweep").exists()


def test_a_failing_seed_stops_the_sweep_with_its_code(checkout):
    done = launch_sweep(checkout, "--seeds", "3", ARGS="run.name=b", FAIL_SEED="1")
    assert done.returncode == 1
    assert "seed 1 (b-seed1) exited with code 1" in done.stderr.splitlines()[-1]
    assert not (checkout / "runs" / "digits" / "b-seed2").exists()


def test_report_only_rebuilds_from_existing_runs(checkout):
    write_runs(checkout / "runs" / "digits", "old", range(3))
    done = launch_sweep(checkout, "--report", "old")
    assert done.returncode == 0, done.stderr
    assert "0.9300 ± 0.0361" in done.stdout
    assert (checkout / "runs" / "digits" / "old-sweep" / "report.json").is_file()
