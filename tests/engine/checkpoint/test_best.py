"""ckpt.best: the checkpoints with the best headline values are kept in best/ beside the
rolling ones, never pruned by ckpt.keep, named in summary.json, continued by a resumed run,
and exported alone (--best) or averaged (--average) by engine.export.

The digits runs here train with a constant, too high learning rate, so that top-1 rises and
falls: the best evaluations are not the last ones, and ckpt.keep=1 prunes their rolling
checkpoints."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import checkpoint as ckpt
from engine import export
from engine.checkpoint import best, sharded
from engine.parts.progress import Progress
from engine.parts.records import Records
from engine.tasks import Classification, NextToken
from tests import helpers

# 1437 training samples: 5 steps per epoch, an evaluation and a checkpoint after each.
SETTINGS = [
    "train.batch_size=256",
    "train.epochs=5",
    "sched.name=constant",
    "optim.lr=1.0",
    "ckpt.keep=1",
    "ckpt.best=2",
]
LAST_STEP = 25


@pytest.fixture(scope="module")
def root(tmp_path_factory, train_here) -> Path:
    """An uninterrupted run, and the same run stopped mid-epoch and resumed (with a stray
    file planted in best/ in between, as an abandoned continuation would leave one). In this
    process (tests/engine/conftest.py)."""
    root = tmp_path_factory.mktemp("best")
    train_here(root, "full", *SETTINGS)
    train_here(root, "resumed", *SETTINGS, "train.stop_at_step=12")
    stray = best.folder(helpers.run_dir(root, "resumed")) / file_name(LAST_STEP + 5)
    stray.write_bytes(b"from a continuation that was abandoned")
    scored = stray.parent / "step-00000002.eval.json"  # make eval's result: not a checkpoint
    scored.write_text("{}")
    train_here(root, "resumed", *SETTINGS)
    assert "resuming from" in (helpers.run_dir(root, "resumed") / "train.log").read_text()
    assert scored.read_text() == "{}"  # kept; the tests below compare checkpoints only
    scored.unlink()
    return root


def best_by_records(root: Path, name: str, k: int = 2) -> list[dict]:
    """The k evaluations with the highest top-1 (ties: the earlier step), from metrics.jsonl."""
    evals = helpers.records(root, name, "eval")
    return sorted(evals, key=lambda r: (-r["top1"], r["step"]))[:k]


def file_name(step: int) -> str:
    return ckpt.checkpoint_path(Path(), step).name


def summary(root: Path, name: str) -> dict:
    return json.loads((helpers.run_dir(root, name) / "summary.json").read_text())


@pytest.mark.slow
def test_the_best_k_are_kept_apart_from_the_rolling_checkpoints(root):
    run = helpers.run_dir(root, "full")
    expected = best_by_records(root, "full")
    names = [file_name(r["step"]) for r in expected]
    assert sorted(p.name for p in best.folder(run).iterdir()) == sorted(names)
    rolling = [p.name for p in (run / "checkpoints").iterdir()]
    assert rolling == [file_name(LAST_STEP)]  # ckpt.keep=1 pruned the rest
    # At least one of the best was pruned from the rolling checkpoints and lives on in best/
    # (the newest may be among the best too: top-1's path differs with the host's float
    # kernels).
    assert set(names) - set(rolling), "every best checkpoint is the newest here"
    for record, name in zip(expected, names, strict=True):
        saved = ckpt.load(best.folder(run) / name)  # what resume=<path> reads
        assert saved["step"] == record["step"] and saved["last_eval"] == record
    assert summary(root, "full")["best_checkpoints"] == [
        {"step": r["step"], "top1": r["top1"], "path": f"best/{n}"}
        for r, n in zip(expected, names, strict=True)
    ]


@pytest.mark.slow
def test_a_stopped_and_resumed_run_ends_with_the_same_best_set(root):
    full, resumed = (best.folder(helpers.run_dir(root, n)) for n in ("full", "resumed"))
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in full.iterdir())
    assert summary(root, "resumed")["best_checkpoints"] == summary(root, "full")["best_checkpoints"]
    for path in full.iterdir():
        again = ckpt.load(resumed / path.name)
        assert helpers.same_weights(ckpt.load(path)["model"], again["model"]), path.name
        assert again["best"] == ckpt.load(path)["best"]


@pytest.mark.slow
def test_export_best_gives_the_best_checkpoints_weights(root, tmp_path, capsys):
    run = helpers.run_dir(root, "full")
    first = best_by_records(root, "full")[0]
    assert export.main([str(run), str(tmp_path / "best.pt"), "--best"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert (
        said[0]
        == f"best checkpoint in {run}: {file_name(first['step'])} (top1 {first['top1']:.6g})"
    )
    exported = torch.load(tmp_path / "best.pt", weights_only=True)
    saved = ckpt.load(best.folder(run) / file_name(first["step"]))["model"]
    assert helpers.same_weights(exported, saved)
    # the run's best/ folder names the same; a run directory alone is still its newest
    assert export.main([str(best.folder(run)), str(tmp_path / "folder.pt")]) == 0
    assert helpers.same_weights(torch.load(tmp_path / "folder.pt", weights_only=True), saved)
    assert export.main([str(run), str(tmp_path / "newest.pt")]) == 0
    newest = ckpt.load(run / "checkpoints" / file_name(LAST_STEP))["model"]
    assert helpers.same_weights(torch.load(tmp_path / "newest.pt", weights_only=True), newest)


@pytest.mark.slow
def test_export_average_is_the_mean_of_the_best_set(root, tmp_path, capsys):
    run = helpers.run_dir(root, "full")
    steps = [r["step"] for r in best_by_records(root, "full")]
    files = [best.folder(run) / file_name(s) for s in steps]
    states = [ckpt.load(f)["model"] for f in files]
    expected = mean_of(states)
    out = tmp_path / "mean.safetensors"
    assert export.main(["--average", str(run), str(out)]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith(
            f"wrote {out}: the mean of the weights of 2 checkpoints (steps {steps[0]}, {steps[1]})"
        )
    )
    from safetensors import safe_open
    from safetensors.torch import load_file

    averaged = load_file(out)
    assert helpers.same_weights(averaged, expected)
    assert not helpers.same_weights(averaged, states[0])  # a real average, not a copy
    counts = [n for n in expected if n.endswith("num_batches_tracked")]
    assert counts and all(states[0][n] != states[1][n] for n in counts)
    with safe_open(out, "pt") as f:
        assert f.metadata()["averaged_steps"] == f"{steps[0]},{steps[1]}"
    # checkpoints named one by one: the two and the newest (three: float32 sums would differ)
    files.append(run / "checkpoints" / file_name(LAST_STEP))
    assert export.main([*map(str, files), str(tmp_path / "named.pt"), "--average"]) == 0
    named = torch.load(tmp_path / "named.pt", weights_only=True)
    assert helpers.same_weights(named, mean_of([ckpt.load(f)["model"] for f in files]))


@pytest.mark.slow
def test_make_export_reads_best_and_average(root, tmp_path):
    """BEST=1 and AVERAGE=1 as EMA=1 is read; with AVERAGE=1, CKPT may name several files."""
    run = helpers.run_dir(root, "full")
    files = [best.folder(run) / file_name(r["step"]) for r in best_by_records(root, "full")]
    states = [ckpt.load(f)["model"] for f in files]
    cases = {
        "best.pt": ({"CKPT": str(run), "BEST": "1"}, states[0]),
        "mean.pt": ({"CKPT": str(run), "AVERAGE": "1"}, mean_of(states)),
        "named.pt": ({"CKPT": " ".join(map(str, files)), "AVERAGE": "1"}, mean_of(states)),
    }
    for name, (variables, expected) in cases.items():
        env = helpers.engine_env(OUT=str(tmp_path / name), MAKEFLAGS="", MAKELEVEL="", **variables)
        make = ["make", "-s", "-o", ".venv/.installed-lock", "export"]
        done = subprocess.run(
            make, cwd=helpers.REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        exported = torch.load(tmp_path / name, weights_only=True)
        assert helpers.same_weights(exported, expected), name


def mean_of(states: list[dict]) -> dict:
    """Floating tensors: the mean in float64, in their own dtype; the others: the first's."""
    expected = {}
    for name, tensor in states[0].items():
        if tensor.is_floating_point():
            mean = torch.stack([s[name].double() for s in states]).mean(dim=0)
            expected[name] = mean.to(tensor.dtype)
        else:  # num_batches_tracked
            expected[name] = tensor
    return expected


@pytest.mark.slow
def test_a_mismatched_set_is_one_line_exit_2_and_no_file(root, tmp_path, capsys):
    """The first case in a process of its own (its exit status and output); the others
    through engine.export's main, whose return is the exit status."""
    run = helpers.run_dir(root, "full")
    good = best.folder(run) / file_name(best_by_records(root, "full")[0]["step"])
    state = ckpt.load(good)
    (name, tensor), *_ = state["model"].items()
    wider = tmp_path / "wider.pt"
    torch.save(state | {"model": state["model"] | {name: torch.zeros(tensor.shape[0] + 1)}}, wider)
    fewer = tmp_path / "fewer.pt"
    torch.save(state | {"model": {k: v for k, v in state["model"].items() if k != name}}, fewer)
    cases = {
        wider: f"cannot average: {name} is {list(tensor.shape)} in {good} but "
        f"[{tensor.shape[0] + 1}] in {wider}",
        fewer: f"cannot average: {fewer} has no tensor {name} ({good} has)",
    }
    out = tmp_path / "o.pt"
    (wider_message, fewer_message) = cases.values()
    done = cli("-m", "engine.export", "--average", str(good), str(wider), str(out))
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"error: {wider_message}\n")
    capsys.readouterr()

    def main(*args: str) -> tuple[int, str, str]:
        code = export.main(list(args))
        said = capsys.readouterr()
        return code, said.out, said.err

    code, said, err = main("--average", str(good), str(fewer), str(out))
    assert (code, said, err) == (2, "", f"error: {fewer_message}\n")
    code, _, err = main(str(good), str(wider), str(out))  # several, no --average
    assert code == 2 and err.count("\n") == 1 and "--average" in err
    code, _, err = main("--best", str(good), str(out))
    assert (code, err) == (2, f"error: {good} is a checkpoint; --best takes a run directory\n")
    assert not out.exists()


@pytest.mark.slow
def test_ckpt_best_0_keeps_no_best_folder(tmp_path, capsys):
    helpers.run_engine(tmp_path, "off", "train.max_steps=2", "ckpt.best=0")
    assert not best.folder(helpers.run_dir(tmp_path, "off")).exists()
    assert summary(tmp_path, "off")["best_checkpoints"] == []
    code = export.main(["--best", str(helpers.run_dir(tmp_path, "off")), str(tmp_path / "o.pt")])
    assert code == 2 and "holds no best checkpoints" in capsys.readouterr().err


# ---------------------------------------------------------------- the parts


def entry(step: int, value: float) -> dict:
    return {"step": step, "value": value, "file": file_name(step)}


def test_ranking_keeps_the_earlier_of_equal_values_and_follows_the_direction():
    entries = [entry(2, 0.5), entry(4, 0.7)]
    assert best.ranked(entries, entry(6, 0.5), 2, higher=True) == [entry(4, 0.7), entry(2, 0.5)]
    assert best.ranked(entries, entry(6, 0.6), 2, higher=True) == [entry(4, 0.7), entry(6, 0.6)]
    assert best.ranked(entries, entry(6, 0.6), 2, higher=False) == [entry(2, 0.5), entry(6, 0.6)]
    assert best.ranked(entries, entry(4, 0.1), 1, higher=True) == [entry(2, 0.5)]  # same step
    assert best.ranked(entries, None, 1, higher=True) == [entry(4, 0.7)]  # a smaller ckpt.best


def test_sync_links_restores_drops_and_clears(tmp_path, capsys):
    checkpoints, folder = tmp_path / "checkpoints", best.folder(tmp_path)
    for step in (2, 4, 6):
        ckpt.atomic_save({"step": step}, checkpoints / file_name(step))
    kept = best.sync(tmp_path, [entry(4, 0.9), entry(2, 0.8)])
    assert kept == [entry(4, 0.9), entry(2, 0.8)]
    for step in (4, 2):  # hard links: the same file, not a copy
        assert (folder / file_name(step)).samefile(checkpoints / file_name(step))
    (folder / file_name(2)).unlink()  # lost: re-linked from its checkpoint
    (checkpoints / file_name(4)).unlink()  # pruned: its best file stays
    (folder / ".step-00000006.pt.1234.tmp").write_bytes(b"")  # a dead writer's leftover
    (folder / file_name(6)).write_bytes(b"")  # evicted, or from an abandoned continuation
    lost = entry(8, 0.95)  # neither a best file nor a checkpoint: dropped, said
    assert best.sync(tmp_path, [lost, entry(4, 0.9), entry(2, 0.8)]) == kept
    assert sorted(p.name for p in folder.iterdir()) == [file_name(2), file_name(4)]
    assert ckpt.load(folder / file_name(4))["step"] == 4
    assert f"best checkpoint {file_name(8)} (step 8) is missing" in capsys.readouterr().err


def test_a_sharded_checkpoint_is_linked_file_by_file(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    source = ckpt.sharded_path(tmp_path / "checkpoints", 6)
    sharded.save(source, model, optimizer, {"step": 6})
    entries = [{"step": 6, "value": 1.0, "file": source.name}]
    assert best.sync(tmp_path, entries, fresh=source.name) == entries
    copy = best.folder(tmp_path) / source.name
    files = sorted(p.relative_to(source) for p in source.rglob("*"))
    assert sorted(p.relative_to(copy) for p in copy.rglob("*")) == files
    assert all((copy / f).samefile(source / f) for f in files if (source / f).is_file())
    assert [p.name for p in best.folder(tmp_path).iterdir()] == [source.name]  # nothing hidden
    tensors, _ = export.read_weights(copy, ema=False)
    assert helpers.same_weights(tensors, model.state_dict())


def test_where_links_are_refused_the_best_file_is_a_copy(tmp_path, monkeypatch):
    ckpt.atomic_save({"step": 2}, tmp_path / "checkpoints" / file_name(2))

    def refuse(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    best.sync(tmp_path, [entry(2, 0.5)])
    copy = best.folder(tmp_path) / file_name(2)
    assert not copy.samefile(tmp_path / "checkpoints" / file_name(2))
    assert ckpt.load(copy) == {"step": 2}


def test_a_best_file_that_cannot_be_written_is_a_warning(tmp_path, capsys):
    ckpt.atomic_save({"step": 2}, tmp_path / "checkpoints" / file_name(2))
    best.folder(tmp_path).write_text("a file where the folder should be")
    run = SimpleNamespace(
        cfg=SimpleNamespace(ckpt=SimpleNamespace(best=1)),
        run_dir=tmp_path,
        records=SimpleNamespace(best=[entry(2, 0.5)]),
    )
    best.place(run, tmp_path / "checkpoints" / file_name(2))  # no exception
    assert "warning: could not update" in capsys.readouterr().err
    assert ckpt.load(tmp_path / "checkpoints" / file_name(2)) == {"step": 2}


def test_average_of_emas_and_of_mixed_dtypes(tmp_path):
    """--ema --average: the mean of the EMAs; a half-precision tensor is averaged in float64
    and stays half precision."""
    paths = []
    for step, scale in ((2, 1.0), (4, 3.0)):
        model = {"w": torch.full((2,), scale, dtype=torch.float16), "n": torch.tensor(step)}
        ema = {"w": torch.full((2,), scale * 10), "n": torch.tensor(step)}
        path = tmp_path / "checkpoints" / file_name(step)
        ckpt.atomic_save({"model": model, "ema": {"model": ema}, "step": step}, path)
        paths.append(str(path))
    assert export.main([*paths, str(tmp_path / "ema.pt"), "--average", "--ema"]) == 0
    assert export.main([*paths, str(tmp_path / "w.pt"), "--average"]) == 0
    ema = torch.load(tmp_path / "ema.pt", weights_only=True)
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(ema["w"], torch.full((2,), 20.0)) and ema["n"] == 2
    assert weights["w"].dtype == torch.float16 and torch.equal(
        weights["w"], torch.full((2,), 2.0, dtype=torch.float16)
    )


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=helpers.engine_env(),
        cwd=helpers.REPO,
    )


def ranked_by_select(task, values: dict[int, float], k: int, run_dir: Path) -> list[dict]:
    """Records.best after best.select ranked a checkpoint at each step, each after an
    evaluation of the task's headline at that step."""
    run = SimpleNamespace(
        cfg=SimpleNamespace(ckpt=SimpleNamespace(best=k)),
        run_dir=run_dir,
        net=SimpleNamespace(strategy=SimpleNamespace(fsdp=False)),
        task=task,
        progress=Progress(),
        records=Records(),
    )
    for step, value in values.items():
        run.progress.step, run.records.last_eval = step, {"step": step, task.headline: value}
        best.select(run)
    return run.records.best


def test_a_lower_is_better_task_keeps_its_lowest_checkpoints(tmp_path):
    """A loss (a language model's, a regression's) ranks its lowest values best."""
    losses = {2: 0.9, 4: 0.4, 6: 0.7, 8: 0.5, 10: 1.2}
    task = NextToken()
    assert task.higher_is_better is False and task.headline == "loss"
    kept = ranked_by_select(task, losses, 2, tmp_path)
    lowest = sorted(losses, key=losses.get)[:2]
    assert kept == [entry(step, losses[step]) for step in lowest]
    # the same values under a higher-is-better headline: the highest, so direction matters
    highest = sorted(losses, key=losses.get, reverse=True)[:2]
    scores = ranked_by_select(Classification(10), losses, 2, tmp_path)
    assert [e["step"] for e in scores] == highest != lowest
