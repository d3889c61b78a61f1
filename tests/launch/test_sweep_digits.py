"""A 2 x 2 grid x 2 seeds on digits with the real engine: stopped by SIGTERM while its third
member trains, then rerun, it runs only what was left and resumes the stopped member; a
learning rate that clearly hurts is reported as significantly worse, and a setting that changes
nothing (the logging interval) as no difference; `make compare` on the same runs agrees."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import scipy.stats

from launch import cli
from tests import helpers

pytestmark = pytest.mark.slow
GRID = "optim.lr=0.1,0.00001 log.every_steps=5,10 train.epochs=2 run.name=pl"
CELLS = [
    "lr0.1-every_steps5",
    "lr0.1-every_steps10",
    "lr0.00001-every_steps5",
    "lr0.00001-every_steps10",
]
MEMBERS = [f"pl-{c}-seed{s}" for s in range(2) for c in CELLS]
STOPPED = MEMBERS[2]


def sweep_env(root: Path) -> dict[str, str]:
    args = f"{GRID} run.root={root} {' '.join(helpers.QUIET)}"
    return helpers.launch_env(helpers.engine_env(), GPUS="0", SEEDS="2", ARGS=args)


def trains(run: Path) -> bool:
    """It has written a training record: it is past its start, inside the loop."""
    path = run / "metrics.jsonl"
    return path.is_file() and b'"kind": "train"' in path.read_bytes()


def stop_while_training(root: Path) -> subprocess.CompletedProcess:
    """The sweep, sent SIGTERM as soon as STOPPED writes its first training record."""
    cmd = [sys.executable, "-m", "launch", "sweep"]
    proc = subprocess.Popen(cmd, cwd=helpers.REPO, env=sweep_env(root), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not trains(root / "digits" / STOPPED) and proc.poll() is None:
        assert time.monotonic() < deadline, "the third member never started training"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def started(stderr: str) -> list[str]:
    return [
        line.split("run.name=")[1].split()[0]
        for line in stderr.splitlines()
        if line.startswith("+ ")
    ]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    first = stop_while_training(root)
    kept = {m: (root / "digits" / m / "metrics.jsonl").read_bytes() for m in MEMBERS[:2]}
    kept["sweep.json"] = (root / "digits" / "pl-sweep" / "sweep.json").read_bytes()
    second = helpers.launch("sweep", timeout=600, **sweep_env(root))
    return root, first, second, kept


def test_a_stopped_sweep_reruns_only_what_was_left(swept):
    root, first, second, kept = swept
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    assert started(first.stderr) == MEMBERS[:3]
    assert first.stderr.splitlines()[-1] == (
        "launch: sweep pl stopped by SIGTERM; rerun the same command to go on"
    )
    record = json.loads(kept.pop("sweep.json"))  # as the stopped sweep left it
    assert record["attempts"][STOPPED]["stopped"] == "SIGTERM"
    assert "3 of 8 members finished" not in first.stdout  # two finished, one stopped
    assert "2 of 8 members finished" in first.stdout.splitlines()[0]

    assert second.returncode == 0, second.stderr[-3000:]
    assert started(second.stderr) == MEMBERS[2:]
    for member, metrics in kept.items():  # finished members are left as they were
        assert (root / "digits" / member / "metrics.jsonl").read_bytes() == metrics
    log = (root / "digits" / "pl-sweep" / "logs" / f"{STOPPED}.log").read_text()
    assert "resuming from" in log, log[-2000:]


def summaries(root: Path) -> dict[str, dict]:
    return {m: json.loads((root / "digits" / m / "summary.json").read_text()) for m in MEMBERS}


def test_the_resumed_member_equals_its_twin_that_ran_through(swept):
    root = swept[0]
    done = summaries(root)
    twin = STOPPED.replace("every_steps5", "every_steps10")  # logging changes nothing trained
    assert done[STOPPED]["top1"] == done[twin]["top1"]
    assert done[STOPPED]["eval_loss"] == done[twin]["eval_loss"]


def test_a_harmful_learning_rate_is_significant_and_a_setting_that_changes_nothing_is_not(swept):
    root = swept[0]
    report = json.loads((root / "digits" / "pl-sweep" / "report.json").read_text())
    by_name = {c["name"]: c for c in report["cells"]}
    assert report["baseline"] == CELLS[0] and report["ranking"][-2:] != CELLS[:2]
    top1 = {m: s["top1"] for m, s in summaries(root).items()}
    # Seed by seed the same values: no difference whether the seeds spread (Welch's p is 1) or,
    # on some CPUs, happen to agree (no spread on either side: the test is undefined).
    assert [top1[f"pl-{CELLS[1]}-seed{s}"] for s in range(2)] == [
        top1[f"pl-{CELLS[0]}-seed{s}"] for s in range(2)
    ]
    same = by_name["lr0.1-every_steps10"]["vs_baseline"]
    assert same["difference"] == 0 and same["p"] in (1.0, None)
    assert same["verdict"].startswith(("no significant difference", "the same"))
    base = [top1[f"pl-{CELLS[0]}-seed{s}"] for s in range(2)]
    for cell in CELLS[2:]:
        bad = [top1[f"pl-{cell}-seed{s}"] for s in range(2)]
        theirs = scipy.stats.ttest_ind(bad, base, equal_var=False)
        mine = by_name[cell]["vs_baseline"]
        assert mine["p"] == theirs.pvalue and [mine["low"], mine["high"]] == list(
            theirs.confidence_interval(0.95)
        )
        assert mine["verdict"].startswith("worse (p=") and mine["p_adjusted"] < 0.05
    assert report["command"]["env"]["SEEDS"] == "2" and report["git"]["sha"]
    assert report["chart"] == "chart.png" and (root / "digits" / "pl-sweep" / "chart.png").is_file()
    markdown = (root / "digits" / "pl-sweep" / "report.md").read_text()
    assert markdown == swept[2].stdout


def test_compare_of_the_same_runs_gives_the_same_numbers(swept, capsys):
    root = swept[0]
    runs = " ".join(str(root / "digits" / m) for m in MEMBERS)
    code = cli.main(["compare"], env={"RUNS": runs})  # in-process: the subject is its numbers
    assert code == 0, capsys.readouterr().err
    data = json.loads(next((root / "digits").glob("compare-*.json")).read_text())
    sweep = json.loads((root / "digits" / "pl-sweep" / "report.json").read_text())
    groups = {c["name"]: c for c in data["cells"]}
    assert list(groups) == ["optim.lr=0.1", "optim.lr=1e-05"]  # log.* is not a setting
    cells = {c["name"]: c for c in sweep["cells"]}
    for group, cell in zip(groups.values(), (CELLS[0], CELLS[2]), strict=True):
        assert group["top1"] == cells[cell]["top1"]  # the duplicate seeds are counted once
        assert group["counts"] == {"finished": 2, "duplicate": 2}
    assert groups["optim.lr=1e-05"]["vs_baseline"]["verdict"].startswith("worse")
