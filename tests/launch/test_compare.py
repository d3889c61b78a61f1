"""`make compare` / `python -m launch compare` on run directories written by hand (config.yaml,
metrics.jsonl, summary.json, as the engine leaves them): no training here."""

import json
import os
from pathlib import Path

import yaml

from launch import cli


def make_run(parent: Path, name: str, recipe: str, seed: int, value: float) -> Path:
    """A finished run of `recipe` whose headline (its task's, in summary.json) is `value`."""
    headline, higher = ("top1", True) if recipe != "regression" else ("eval_loss", False)
    folder = parent / name
    folder.mkdir(parents=True)
    config = {"recipe": recipe, "seed": seed, "run": {"name": name}, "optim": {"lr": 0.1}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    metric = headline.removeprefix("eval_")
    record = {"kind": "eval", "step": 4, "epoch": 0, metric: value, "count": 10}
    (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    summary = {headline: value, "headline": headline, "higher_is_better": higher}
    summary |= {"seconds": 1.5, "steps": 4, "epochs": 0, "world_size": 1}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_runs_of_two_recipes_are_refused_in_one_line_naming_both(tmp_path, capsys):
    runs = tmp_path / "runs"
    first = make_run(runs / "regression", "fit", "regression", 0, 0.25)
    other = make_run(runs / "imagenet", "resnet", "imagenet", 0, 0.75)
    code = cli.main(["compare", str(first), str(other)], env={})
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("launch: cannot compare runs of different")
    assert "regression/fit is regression" in err and "imagenet/resnet is imagenet" in err
    assert f'compare runs of one recipe, e.g. RUNS="{first}"' in err
    assert sorted(os.listdir(runs)) == ["imagenet", "regression"]  # nothing written


def test_runs_of_one_recipe_are_still_compared(tmp_path, capsys):
    a = [make_run(tmp_path, f"a{s}", "digits", s, 0.5 + s / 100) for s in range(2)]
    code = cli.main(["compare", *map(str, a)], env={})
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Comparison of 2 runs in 1 group" in out
    assert (tmp_path / "compare-a0+a1.md").is_file()


def with_hardware(run: Path, **facts) -> Path:
    """The run's env.json records the hardware engine.hardware writes (these fields)."""
    hardware = {"cpu_model": "AMD EPYC", "cpu_capability": "AVX512", "torch": "2.14.1"} | facts
    (run / "env.json").write_text(json.dumps({"hardware": hardware}))
    return run


def test_runs_on_different_hardware_get_one_note_naming_what_differs(tmp_path, capsys):
    a = [with_hardware(make_run(tmp_path, f"a{s}", "digits", s, 0.5)) for s in range(2)]
    b = [make_run(tmp_path, f"b{s}", "digits", s, 0.6) for s in range(2)]
    with_hardware(b[0], cpu_capability="AVX2")  # b1 records none: an older run, unknown
    code = cli.main(["compare", *map(str, a + b)], env={})
    out, err = capsys.readouterr()
    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: these runs ran on different hardware (cpu_capability AVX512 vs AVX2; 1 of 4 "
        "runs record no hardware (unknown)): bitwise equality is not expected, only "
        "statistical agreement"
    ]
    saved = json.loads((tmp_path / "compare-a0+a1+b0+b1.json").read_text())
    assert saved["hardware_note"] == notes[0]


def test_runs_on_the_same_hardware_get_no_note(tmp_path, capsys):
    a = [with_hardware(make_run(tmp_path, f"a{s}", "digits", s, 0.5 + s / 100)) for s in range(2)]
    code = cli.main(["compare", *map(str, a)], env={})
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "hardware" not in out


def with_data(run: Path, train_sha: str, files: int) -> Path:
    """The run's summary.json names its data as the engine records it (the brief form)."""
    summary = json.loads((run / "summary.json").read_text())
    train = {"method": "index", "sha256": train_sha, "count": files, "unit": "files"}
    train["summary"] = f"{files} files in 3 classes"
    held_out = {"method": "index", "sha256": "e" * 64, "count": 6, "unit": "files"}
    summary["data"] = {"train": train, "eval": held_out | {"summary": "6 files in 3 classes"}}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_runs_on_different_data_are_never_pooled_and_get_one_note(tmp_path, capsys):
    same = [with_data(make_run(tmp_path, f"a{s}", "digits", s, 0.5), "a" * 64, 18) for s in (0, 1)]
    other = [with_data(make_run(tmp_path, f"b{s}", "digits", s, 0.6), "b" * 64, 19) for s in (0, 1)]
    code = cli.main(["compare", *map(str, same + other)], env={})
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Comparison of 4 runs in 2 groups by data" in out
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: these runs trained on different data (train aaaaaaaa eval eeeeeeee: train 18 "
        "files in 3 classes, eval 6 files in 3 classes; train bbbbbbbb eval eeeeeeee: train 19 "
        "files in 3 classes, eval 6 files in 3 classes): runs on other data are kept in groups "
        "of their own, never pooled"
    ]
    saved = json.loads((tmp_path / "compare-a0+a1+b0+b1.json").read_text())
    groups = {c["name"]: [m["run"] for m in c["members"]] for c in saved["cells"]}
    assert groups == {
        "data=train aaaaaaaa eval eeeeeeee": ["a0", "a1"],
        "data=train bbbbbbbb eval eeeeeeee": ["b0", "b1"],
    }


def test_runs_on_the_same_data_or_unrecorded_data_are_one_group(tmp_path, capsys):
    a = [with_data(make_run(tmp_path, f"a{s}", "digits", s, 0.5), "a" * 64, 18) for s in (0, 1)]
    older = make_run(tmp_path, "a2", "digits", 2, 0.52)  # recorded before runs named their data
    code = cli.main(["compare", *map(str, [*a, older])], env={})
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Comparison of 3 runs in 1 group" in out and "different data" not in out


def test_placement_and_checkpoint_keys_are_not_settings_runs_differ_in(tmp_path, capsys):
    """Where a run was placed (slurm.*) and how often it saved (ckpt.*) do not change what it
    trained: runs differing only in them are one group."""
    runs = [make_run(tmp_path, f"a{s}", "digits", s, 0.5 + s / 100) for s in range(3)]
    for run, (partition, every) in zip(runs, [("gpu", 0), ("cpu", 50), ("gpu", 200)], strict=True):
        config = yaml.safe_load((run / "config.yaml").read_text())
        config |= {"slurm": {"partition": partition}, "ckpt": {"every_steps": every}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    code = cli.main(["compare", *map(str, runs)], env={})
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Comparison of 3 runs in 1 group" in out and "slurm.partition" not in out


def test_a_pattern_leaves_out_the_folders_without_records_and_names_them(tmp_path, capsys):
    """RUNS='runs/digits/lr-*' where one member failed at its start and one is still queued:
    the finished ones are compared, the others named; a folder named alone is still refused."""
    done = [make_run(tmp_path, f"lr-{s}", "digits", s, 0.5 + s / 100) for s in range(2)]
    failed = tmp_path / "lr-2"
    failed.mkdir()
    (failed / "config.yaml").write_text("recipe: digits\nseed: 2\n")
    (failed / "metrics.jsonl").write_text("")  # died before its first step
    queued = tmp_path / "lr-3" / "request"  # a queued member: its frozen config alone
    queued.mkdir(parents=True)
    code = cli.main(["compare"], env={"RUNS": f"{tmp_path}/lr-*"})
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Comparison of 2 runs in 1 group" in out
    assert err.startswith(f"compare: left out 2 matched folder(s) with no training records: "
                          f"{failed}, {queued.parent}\n")  # fmt: skip
    assert all((run / "summary.json").is_file() for run in done)
    code = cli.main(["compare", str(done[0]), str(queued.parent)], env={})
    assert code == 2 and capsys.readouterr().err.startswith("launch: ")


def test_the_headline_is_in_the_log_s_unit_and_intervals_stay_where_values_can_be():
    """top-1 in percent everywhere, as the training log says it; a time's or an accuracy's
    interval never reaches values the quantity cannot take."""
    from launch.analysis import compare

    assert compare.in_unit("top1")(0.98889) == "98.89%"
    assert compare.in_unit("top1", signed=True)(-0.004) == "-0.40%"
    assert compare.in_unit("eval_loss")(0.12345) == "0.1235"
    assert compare.interval(-9.0, 66.2, compare.seconds_text) == "[0.0, 66.2]"
    assert compare.bounded("top1", -0.2, 1.3) == (0.0, 1.0)
    assert compare.bounded("eval_loss", -0.2, 1.3) == (-0.2, 1.3)
