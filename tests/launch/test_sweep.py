"""launch.grid, launch.analysis.stats and `python -m launch sweep|compare` with a fake engine:
grids from ARGS and sweep files, the statistics against scipy's own, resuming a sweep,
refusing a changed grid, the dry runs (a job array with a concurrency limit).
tests/launch/test_sweep_digits.py runs a grid with the real engine; tests/slurm submits one."""

import fcntl
import json
import random
import subprocess
from pathlib import Path

import pytest
import scipy.stats

from launch import grid, runs
from launch import sweep_members as sweep
from launch.analysis import cells, stats
from launch.errors import UserError
from tests import helpers

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- grids


def test_a_grid_from_args_is_every_combination_named_by_its_settings():
    g = grid.build(["optim.lr=0.05,0.1", "mix.mixup_alpha=0,0.2", "train.epochs=3"], None, None)
    assert [c.name for c in g.cells] == [
        "lr0.05-mixup_alpha0", "lr0.05-mixup_alpha0.2", "lr0.1-mixup_alpha0", "lr0.1-mixup_alpha0.2",
    ]  # fmt: skip
    assert g.cells[3].overrides == ("optim.lr=0.1", "mix.mixup_alpha=0.2")
    assert g.fixed == ("train.epochs=3",) and g.baseline_cell() == g.cells[0]
    assert grid.member_name("lr", g.cells[1], 2) == "lr-lr0.05-mixup_alpha0.2-seed2"
    only_seeds = grid.build(["train.epochs=3"], None, None)
    assert [c.name for c in only_seeds.cells] == [""]
    assert grid.member_name("s", only_seeds.cells[0], 1) == "s-seed1"


def test_commas_inside_lists_and_quotes_do_not_split():
    assert grid.split_values("[0.9,0.99],[0.8,0.9]") == ["[0.9,0.99]", "[0.8,0.9]"]
    assert grid.split_values("'a,b',c") == ["'a,b'", "c"]
    g = grid.build(["optim.betas=[0.9,0.99]"], None, None)
    assert g.axes == () and g.fixed == ("optim.betas=[0.9,0.99]",)


def test_two_keys_with_one_last_part_are_named_in_full():
    g = grid.build(["optim.lr=0.1,0.2", "head.lr=1,2"], None, None)
    assert g.cells[0].name == "optim_lr0.1-head_lr1"


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["optim.lr=0.1,0.10"], "ARGS: optim.lr lists the value 0.1 twice"),
        (["optim.lr=0.1,"], "ARGS: optim.lr has an empty value"),
        (["seed=0,1"], "ARGS: seed cannot be swept; SEEDS=N runs seeds 0..N-1"),
        (["optim.lr=0.1,0.2", "optim.lr=0.3"], "ARGS: optim.lr is swept and also set"),
        (["optim.lr=0.1,0.2", "optim.lr=0.3,0.4"], "ARGS: optim.lr is swept twice"),
        (["x=a b,a_b"], "ARGS: two cells would both be named 'xa_b'"),
    ],
)
def test_a_bad_grid_is_one_line(words, said):
    with pytest.raises(UserError, match="^" + said.replace("(", r"\(").replace(")", r"\)")):
        grid.build(words, None, None)


SWEEP_FILE = """\
name: warm
seeds: 2
parallel: 3
grid:
  optim.lr: [0.05, 0.1]
zip:
  - {sched.warmup_steps: [10, 40], train.epochs: [5, 20]}
baseline: {optim.lr: 0.1, train.epochs: 5}
overrides: [log.every_steps=5]
"""


def test_a_sweep_file_zips_keys_and_names_its_baseline(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP_FILE)
    g = grid.build(["model.width=16"], str(path), None)
    assert [c.name for c in g.cells] == [
        "lr0.05-warmup_steps10-epochs5", "lr0.05-warmup_steps40-epochs20",
        "lr0.1-warmup_steps10-epochs5", "lr0.1-warmup_steps40-epochs20",
    ]  # fmt: skip
    assert g.baseline_cell().name == "lr0.1-warmup_steps10-epochs5"
    assert g.fixed == ("log.every_steps=5", "model.width=16")
    assert (g.name, g.seeds, g.parallel) == ("warm", 2, 3)
    by_flag = grid.build([], str(path), "optim.lr=0.05 train.epochs=20")
    assert by_flag.baseline_cell().name == "lr0.05-warmup_steps40-epochs20"


def test_a_sweep_file_sweeps_lists_as_values(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("grid:\n  optim.betas: [[0.9, 0.99], [0.8, 0.9]]\n  optim.name: [adamw, sgd]\n")
    g = grid.build([], str(path), None)
    assert [c.name for c in g.cells][:2] == ["betas0.9_0.99-nameadamw", "betas0.9_0.99-namesgd"]
    assert g.cells[3].overrides == ("optim.betas=[0.8, 0.9]", "optim.name=sgd")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("grid: {optim.lr: [0.1]}\nbogus: 1\n", "unknown key 'bogus'"),
        ("grid: {optim.lr: 0.1}\n", "optim.lr needs a list of values"),
        (
            "zip: [{a.b: [1, 2], c.d: [1]}]\n",
            "its lists must be of one length (a.b has 2, c.d has 1)",
        ),
        ("grid: {optim.lr: [0.1, 0.2]}\nbaseline: {optim.lr: 0.3}\n", "matches no cell"),
        ("grid: {optim.lr: [0.1, 0.2]}\nbaseline: {optim.wd: 0}\n", "baseline names optim.wd"),
        ("grid: [1, 2\n", "is not valid YAML (line 2)"),
        ("seeds: 0\n", "seeds: 0 is not a whole number >= 1"),
    ],
)
def test_a_bad_sweep_file_is_one_line(tmp_path, text, said):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        grid.build([], str(path), None)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_differences_name_what_changed():
    old = grid.build(["optim.lr=0.1,0.2", "train.epochs=3"], None, None).identity()
    new = grid.build(["optim.lr=0.1,0.3", "train.epochs=4"], None, None).identity()
    assert grid.differences(old, new) == [
        "optim.lr was 0.1,0.2, now 0.1,0.3",
        "the fixed overrides were train.epochs=3, now train.epochs=4",
    ]
    assert grid.differences(old, old) == []


# ---------------------------------------------------------------- the statistics


def samples(seed: int, n: int, mean: float) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, 0.02) for _ in range(n)]


@pytest.mark.parametrize(("n", "m", "shift"), [(2, 2, 0.0), (3, 5, 0.01), (8, 4, 0.05)])
def test_welch_p_value_and_interval_are_scipys(n, m, shift):
    a, b = samples(n, n, 0.9 + shift), samples(m + 100, m, 0.9)
    mine = stats.welch(a, b)
    theirs = scipy.stats.ttest_ind(a, b, equal_var=False)
    low, high = theirs.confidence_interval(0.95)
    assert (mine.p, mine.t, mine.df) == (theirs.pvalue, theirs.statistic, theirs.df)
    assert (mine.low, mine.high) == (low, high)
    assert mine.difference == pytest.approx(sum(a) / n - sum(b) / m, abs=1e-15)


def test_a_cells_interval_is_students_t_interval_of_the_mean():
    values = samples(7, 5, 0.5)
    mine = stats.describe(values)
    sem = scipy.stats.sem(values)
    low, high = scipy.stats.t.interval(0.95, len(values) - 1, loc=mine.mean, scale=sem)
    assert (mine.low, mine.high) == pytest.approx((low, high), rel=1e-12)
    assert mine.std == pytest.approx(scipy.stats.tstd(values), rel=1e-12)  # n - 1
    assert stats.describe([0.5]) == stats.Summary(1, 0.5)  # no std, no interval


def test_adjusted_p_values_are_scipys_benjamini_hochberg():
    ps = [0.01, 0.04, 0.03, 0.5]
    assert stats.adjust(ps) == list(scipy.stats.false_discovery_control(ps))


def judged(a: list[float], b: list[float], higher: bool = True) -> stats.Comparison:
    return stats.judge([stats.welch(a, b)], [(len(a), len(b))], higher)[0]


def test_verdicts():
    good, bad = samples(1, 3, 0.9), samples(2, 3, 0.3)
    assert judged(bad, good).verdict.startswith("worse (p=")
    assert judged(good, bad).verdict.startswith("better (p=")
    assert judged(bad, good, higher=False).verdict.startswith("better")  # a loss went down
    same = judged(good, list(good))
    assert same.p == 1.0 and same.verdict.startswith("no significant difference (p=1.0000)")
    assert "too few seeds to tell (n=2)" in judged(good[:2], good[1:]).verdict
    assert judged(good[:1], bad).verdict.startswith("too few seeds to tell (n=1")
    flat = judged([0.5, 0.5], [0.5, 0.5])
    assert flat.p is None and flat.verdict.startswith("the same")


# ---------------------------------------------------------------- through the CLI

FAKE_TRAIN = """\
import json, os, sys
from pathlib import Path

def main(argv):
    if "--check" in argv:  # the engine refuses a value, in its one line
        bad = [a for a in argv if a.endswith("=abc")]
        print(*(f"error: {b}: not a number" for b in bad[:1]), file=sys.stderr)
        return 2 if bad else 0
    recipe, args = argv[0], dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    name, seed, lr = args["run.name"], int(args["seed"]), float(args.get("optim.lr", 0.1))
    run = Path(args.get("run.root", "runs")) / recipe / name
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("")
    (run / "config.yaml").write_text(json.dumps({"seed": seed, "optim": {"lr": lr},
                                                 "log": {"every_steps": args.get("log.every_steps")}}))
    task = {"headline": "top1", "higher_is_better": True, "unit": "samples"}
    (run / "env.json").write_text(json.dumps({"task": task, "git_sha": "abc"}))
    print(f"training {name}", file=sys.stderr)
    if os.environ.get("FAIL_RUN") and name.endswith(os.environ["FAIL_RUN"]):
        print(f"RuntimeError: planted failure in {name}", file=sys.stderr)
        return 1
    top1 = 0.9 - abs(lr - 0.1) + 0.01 * seed
    summary = {"top1": top1, "seconds": 1.0 + seed, "steps": 10, "world_size": 1,
               "group": os.environ.get("WANDB_RUN_GROUP"), "headline": "top1", "higher_is_better": True}
    (run / "summary.json").write_text(json.dumps(summary))
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""
GRID = "optim.lr=0.1,0.5 log.every_steps=5,10 run.name=g"


@pytest.fixture
def checkout(tmp_path):
    return helpers.fake_checkout(tmp_path / "checkout", FAKE_TRAIN, "seed: 0\n")


def launch_sweep(checkout: Path, *args, **env) -> subprocess.CompletedProcess:
    return helpers.launch("sweep", *args, cwd=checkout, timeout=120, **{"GPUS": "0", **env})


def ran(done: subprocess.CompletedProcess) -> list[str]:
    """The members a sweep started, in order."""
    return [
        line.split("run.name=")[1].split()[0]
        for line in done.stderr.splitlines()
        if line.startswith("+ ")
    ]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A checkout where the 2-seed GRID sweep has run (once for the module), its launch, and
    its report.md and report.json as that launch left them."""
    checkout = helpers.fake_checkout(
        tmp_path_factory.mktemp("swept") / "checkout", FAKE_TRAIN, "seed: 0\n"
    )
    done = launch_sweep(checkout, SEEDS="2", ARGS=GRID)
    folder = checkout / "runs" / "digits" / "g-sweep"
    left = [(folder / n).read_text() if (folder / n).is_file() else None for n in REPORTS]
    return checkout, done, left


REPORTS = ("report.md", "report.json")


def test_a_local_grid_sweep_runs_each_member_once_seed_major_and_reports(swept):
    _, done, (report_md, report_json) = swept
    assert done.returncode == 0, done.stderr
    cell_names = [
        "lr0.1-every_steps5",
        "lr0.1-every_steps10",
        "lr0.5-every_steps5",
        "lr0.5-every_steps10",
    ]
    assert ran(done) == [f"g-{c}-seed{s}" for s in range(2) for c in cell_names]
    assert done.stdout == report_md
    data = json.loads(report_json)
    assert data["grid"]["axes"] == {"optim.lr": ["0.1", "0.5"], "log.every_steps": ["5", "10"]}
    assert data["command"]["make"] == f"make sweep SEEDS=2 GPUS=0 ARGS='{GRID}'"
    assert "sha" in data["git"] and data["seeds"] == 2 and data["baseline"] == cell_names[0]
    assert data["ranking"][:2] == cell_names[:2]  # lr 0.1 is better in the fake engine
    cell = {c["name"]: c for c in data["cells"]}["lr0.5-every_steps5"]
    assert cell["counts"] == {"finished": 2}
    assert cell["top1"]["mean"] == pytest.approx(0.9 - 0.4 + 0.005)
    assert cell["vs_baseline"]["difference"] == pytest.approx(-0.4)
    assert cell["members"][0]["summary"]["group"] == "g"  # one W&B group per sweep
    assert "| lr0.1-every_steps10 | +0.00% |" in done.stdout


def test_a_failed_member_is_listed_with_its_last_line_and_a_rerun_runs_only_it(checkout):
    failing = "g-lr0.5-every_steps5-seed0"
    done = launch_sweep(checkout, SEEDS="2", ARGS=GRID, FAIL_RUN=failing)
    assert done.returncode == 1 and len(ran(done)) == 8  # the others still ran
    assert done.stderr.splitlines()[-1] == (
        f"launch: sweep g: 7 of 8 members finished (1 failed); {failing}: RuntimeError: planted "
        f"failure in {failing}; fix that, then rerun the same command to run the rest"
    )
    row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {failing} |"))
    assert f"| failed | – | – | RuntimeError: planted failure in {failing} |" in row
    assert "| lr0.5-every_steps5 | 0.5 | 5 | 1 finished, 1 failed | 51.00% |" in done.stdout
    again = launch_sweep(checkout, SEEDS="2", ARGS=GRID)
    assert again.returncode == 0, again.stderr
    assert ran(again) == [failing]


def test_a_stopped_members_line_is_its_own_not_sruns_report_that_it_ended(tmp_path):
    log = tmp_path / "5_0_0_log.err"
    log.write_text(
        "step 540/880 epoch 25 loss 0.0100\n"
        "stopped at step 540 (preempted: SIGTERM); checkpoint saved\n"
        "srun: error: node1: task 0: Exited with exit code 75\n"
        "submitit WARNING (2026-12-06 14:40:01) - Bypassing signal SIGCONT\n"
    )
    assert sweep.last_line(log) == "stopped at step 540 (preempted: SIGTERM); checkpoint saved"
    assert sweep.last_line(tmp_path / "missing.err") is None


@pytest.mark.slow
def test_an_unnamed_sweep_says_which_name_to_rerun_it_with(checkout):
    done = launch_sweep(checkout, SEEDS="1", ARGS="optim.lr=0.1,0.5", FAIL_RUN="-lr0.5-seed0")
    assert done.returncode == 1
    name = done.stderr.split("sweep ", 1)[1].split(":", 1)[0]  # "sweep <name>: 0 of 2 ..."
    assert "-digits-" in name  # a new time-stamped name, as a training run gets
    assert done.stderr.splitlines()[-1].endswith(
        f"rerun the same command with run.name={name} in ARGS to run the rest"
    )
    again = launch_sweep(checkout, SEEDS="1", ARGS=f"optim.lr=0.1,0.5 run.name={name}")
    assert again.returncode == 0 and ran(again) == [f"{name}-lr0.5-seed0"]


def test_a_changed_grid_under_the_same_name_is_one_line_and_runs_nothing(checkout):
    assert launch_sweep(checkout, SEEDS="1", ARGS=GRID).returncode == 0
    done = launch_sweep(checkout, SEEDS="1", ARGS=GRID.replace("0.1,0.5", "0.1,0.2"))
    assert done.returncode == 2 and ran(done) == []
    assert done.stderr.splitlines() == [
        "launch: sweep g already exists with another grid: optim.lr was 0.1,0.5, now 0.1,0.2; "
        "rerun it as it was, or give the new grid a new name (run.name=...)"
    ]


def test_a_value_the_engine_refuses_is_one_line_and_the_fixed_grid_then_runs(checkout):
    done = launch_sweep(checkout, SEEDS="1", ARGS=GRID.replace("0.1,0.5", "0.1,abc"))
    assert done.returncode == 2 and ran(done) == []
    assert done.stderr.splitlines()[-1].startswith("launch: optim.lr=abc: not a number")
    assert not (checkout / "runs" / "digits" / "g-sweep").exists()  # nothing recorded
    assert launch_sweep(checkout, SEEDS="1", ARGS=GRID).returncode == 0


@pytest.mark.slow
def test_logging_and_placement_are_not_part_of_the_grid(checkout):
    assert launch_sweep(checkout, SEEDS="1", ARGS=GRID).returncode == 0
    done = launch_sweep(checkout, SEEDS="1", ARGS=f"{GRID} log.wandb=off")
    assert done.returncode == 0 and ran(done) == [], done.stderr


def test_a_pasted_credential_is_never_recorded(checkout):
    secret = "sk-0123456789abcdef"
    done = launch_sweep(checkout, SEEDS="1", ARGS=f"{GRID} log.note={secret}", MY_API_KEY=secret)
    assert done.returncode == 0, done.stderr
    folder = checkout / "runs" / "digits" / "g-sweep"
    for name in ("sweep.json", "report.json", "report.md"):
        text = (folder / name).read_text()
        assert secret not in text and "<redacted MY_API_KEY>" in text, name


def test_a_second_launch_of_a_running_sweep_is_one_line(checkout):
    folder = checkout / "runs" / "digits" / "g-sweep"
    folder.mkdir(parents=True)
    with open(folder / ".lock", "w") as held:  # as a launch running the sweep holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        done = launch_sweep(checkout, SEEDS="1", ARGS=GRID)
    assert done.returncode == 2 and ran(done) == []
    assert done.stderr == (
        "launch: sweep g is being run by another launch now; wait for it, or stop it and rerun\n"
    )
    assert launch_sweep(checkout, SEEDS="1", ARGS=GRID).returncode == 0  # released: it runs


@pytest.mark.slow
def test_seeds_can_grow_but_not_shrink(checkout):
    assert launch_sweep(checkout, SEEDS="1", ARGS=GRID).returncode == 0
    more = launch_sweep(checkout, SEEDS="2", ARGS=GRID)
    assert more.returncode == 0 and ran(more) == [n for n in ran(more) if n.endswith("-seed1")]
    assert len(ran(more)) == 4
    fewer = launch_sweep(checkout, SEEDS="1", ARGS=GRID)
    assert fewer.returncode == 2 and "has 2 seeds; SEEDS=1 would leave some out" in fewer.stderr
    same = launch_sweep(checkout, ARGS=GRID)  # SEEDS unset: the sweep's own
    assert same.returncode == 0 and ran(same) == []
    dry = launch_sweep(checkout, DRY_RUN="1", SEEDS="3", ARGS=GRID)  # what a rerun would run
    assert dry.returncode == 0 and len(dry.stdout.splitlines()) == 4
    assert all(line.endswith(" seed=2") for line in dry.stdout.splitlines())


def test_the_report_alone_rebuilds_from_sweep_json(swept):
    checkout, sweep, _ = swept
    assert sweep.returncode == 0, sweep.stderr
    folder = checkout / "runs" / "digits" / "g-sweep"
    before = (folder / "report.json").read_text()
    (folder / "report.json").unlink()
    done = launch_sweep(checkout, "--report", "g")
    assert done.returncode == 0, done.stderr
    assert json.loads((folder / "report.json").read_text())["cells"] == json.loads(before)["cells"]


def test_local_dry_run_prints_one_command_per_member(checkout):
    done = launch_sweep(checkout, DRY_RUN="1", SEEDS="2", ARGS=GRID)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 8
    last = done.stdout.splitlines()[-1]
    assert "run.name=g-lr0.5-every_steps10-seed1 " in last and last.endswith(" seed=1")
    assert not (checkout / "runs").exists()


def test_parallel_is_for_slurm_only(checkout):
    done = launch_sweep(checkout, PARALLEL="2", ARGS=GRID)
    assert done.returncode == 2 and "PARALLEL=2 limits a SLURM job array" in done.stderr


def test_slurm_dry_run_is_one_array_of_every_member_with_its_concurrency_limit(checkout):
    done = launch_sweep(checkout, DRY_RUN="1", SEEDS="2", TARGET="submit", PARALLEL="3", ARGS=GRID)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("#!/bin/bash\n") == 1 and "#SBATCH --array=0-7%3\n" in done.stdout
    tasks = [line for line in done.stdout.splitlines() if line.startswith("#   array task ")]
    assert len(tasks) == 8 and "runs/digits/g-lr0.1-every_steps10-seed0/request/" in tasks[1]
    assert "run.name=g-lr0.1-every_steps10-seed0" in done.stdout  # what it was resolved from
    assert not (checkout / "runs").exists()


def test_compare_groups_finished_runs_by_what_differs(swept):
    checkout, sweep, _ = swept
    assert sweep.returncode == 0, sweep.stderr
    parent = checkout / "runs" / "digits"
    done = helpers.launch("compare", cwd=checkout, timeout=120, RUNS=f"{parent}/g-lr*")
    assert done.returncode == 0, done.stderr
    # log.* is bookkeeping: two groups by optim.lr, each with a duplicate seed left out
    data = json.loads(next(parent.glob("compare-*.json")).read_text())
    assert [c["name"] for c in data["cells"]] == ["optim.lr=0.1", "optim.lr=0.5"]
    assert data["cells"][1]["top1"]["n"] == 2
    assert data["cells"][1]["vs_baseline"]["difference"] == pytest.approx(-0.4)
    assert done.stdout == next(parent.glob("compare-*.md")).read_text()


def test_compare_refuses_a_baseline_that_names_no_group(swept):
    checkout, sweep, _ = swept
    assert sweep.returncode == 0, sweep.stderr
    parent = checkout / "runs" / "digits"
    done = helpers.launch("compare", cwd=checkout, RUNS=f"{parent}/g-lr*", BASELINE="optim.lr=7")
    assert done.returncode == 2
    assert done.stderr == (
        "launch: BASELINE='optim.lr=7' matches no group; the groups are: optim.lr=0.1; optim.lr=0.5\n"
    )


def test_cells_rank_best_first_in_the_headlines_direction():
    def cell(name, values):
        members = [
            runs.Member(f"{name}{i}", i, Path("."), runs.FINISHED, {"loss": v})
            for i, v in enumerate(values)
        ]
        return cells.CellResults(name, {}, members)

    found = [cell("a", [0.5, 0.6]), cell("b", [0.1, 0.2]), cell("c", [])]
    lower = cells.rank(found, runs.Headline("loss", higher_is_better=False))
    higher = cells.rank(found, runs.Headline("loss", higher_is_better=True))
    assert [c.name for c in lower] == ["b", "a", "c"] and [c.name for c in higher] == [
        "a",
        "b",
        "c",
    ]
