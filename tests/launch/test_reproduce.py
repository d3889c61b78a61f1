"""`make reproduce` / `python -m launch reproduce`: its judgement of reruns against a recipe's
results.yaml, on run directories written by hand (summary.json, env.json): no training."""

import json
from pathlib import Path

import pytest

from launch import claims as reproduce
from launch import cli
from launch.analysis.reproduce import judge_runs

HERE = {"cpu_model": "AMD EPYC", "cpu_capability": "AVX512", "torch": "2.14.1+cu130"}
RECORDED = (0.9888579387186629, 0.9832869080779945, 0.9916434540389972)


def claims(values=RECORDED, **measured) -> reproduce.Claims:
    runs = tuple(reproduce.Claim((f"seed={i}",), v) for i, v in enumerate(values))
    return reproduce.Claims("digits", "top1", runs, HERE | {"date": "2026-12-05"} | measured)


def rerun_dir(parent: Path, seed: int, value: float, hardware: dict | None = HERE) -> Path:
    """A finished rerun as the engine leaves it: its headline and, unless None, its hardware."""
    folder = parent / f"s{seed}"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"top1": value, "headline": "top1"}))
    env = {"torch": "2.14.1+cu130"} | ({"hardware": hardware} if hardware else {})
    (folder / "env.json").write_text(json.dumps(env))
    return folder


def judged(tmp_path: Path, values, hardware: dict | None = HERE, recorded=RECORDED):
    dirs = [rerun_dir(tmp_path, s, v, hardware) for s, v in enumerate(values)]
    return judge_runs(claims(recorded), dirs)


def test_same_hardware_and_the_same_bits_agree(tmp_path):
    verdict = judged(tmp_path, RECORDED)
    assert verdict.agree
    assert verdict.lines[0] == "seed=0: recorded 0.9888579387186629, now 0.9888579387186629 (equal)"
    assert verdict.lines[-1] == "bitwise: same hardware (AMD EPYC, AVX512, 2.14.1+cu130): agree"


def test_same_hardware_and_one_bit_off_disagree(tmp_path):
    off = (RECORDED[0], RECORDED[1] + 1e-16, RECORDED[2])  # within any statistical spread
    verdict = judged(tmp_path, off)
    assert not verdict.agree
    assert verdict.lines[1].endswith("(differs)")
    assert (
        verdict.lines[-1].startswith("bitwise: same hardware") and "DISAGREE" in verdict.lines[-1]
    )


def test_a_value_is_checked_to_the_digits_it_records(tmp_path):
    verdict = judged(tmp_path, RECORDED, recorded=(0.9889, 0.9833, 0.9916))
    assert verdict.agree and verdict.lines[-1].startswith("bitwise:")


def test_other_hardware_agrees_within_the_seeds_spread(tmp_path):
    other = HERE | {"cpu_capability": "AVX2"}
    verdict = judged(tmp_path, (0.9916434540389972, 0.9860724233983287, 0.9888579387186629), other)
    assert verdict.agree
    assert verdict.lines[-1].startswith(
        "statistical: different hardware (cpu_capability AVX512 vs AVX2), Welch p=0.77"
    )
    assert verdict.lines[-1].endswith(": agree")


def test_other_hardware_and_another_mean_disagree(tmp_path):
    verdict = judged(tmp_path, (0.90, 0.91, 0.92), HERE | {"torch": "2.11.0"})
    assert not verdict.agree
    assert "(torch 2.14.1+cu130 vs 2.11.0)" in verdict.lines[-1]
    assert verdict.lines[-1].endswith("DISAGREE")


def test_reruns_that_record_no_hardware_are_judged_statistically(tmp_path):
    verdict = judged(tmp_path, RECORDED, hardware=None)
    assert verdict.agree  # the same values: no difference at all
    assert "this machine's is unknown" in verdict.lines[-1]


def test_a_recipe_without_results_is_one_line_exit_2(capsys):
    code = cli.main(["reproduce", "--recipe", "cifar10"], env={})
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("launch: recipe cifar10 records no results to reproduce")
    assert "recipes with one: digits" in err


def test_the_dry_run_prints_each_recorded_request_as_a_new_run(capsys):
    code = cli.main(["reproduce", "--recipe", "digits"], env={"DRY_RUN": "1", "GPUS": "0"})
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3
    for seed, line in enumerate(lines):
        assert f"seed={seed} log.wandb=off run.root=runs/reproduce run.name=" in line


@pytest.mark.parametrize(("shift", "code"), [(0.0, 0), (0.05, 1)])
def test_the_command_exits_by_its_verdict(tmp_path, monkeypatch, capsys, shift, code):
    """The reruns replaced by run directories holding the recorded value (+ shift)."""
    recorded = reproduce.load("digits", {})

    def fake_rerun(req):
        seed = int(reproduce.request.override_value(req.overrides, "seed"))
        return rerun_dir(tmp_path, seed, recorded.claims[seed].value + shift, recorded.measured)

    monkeypatch.setattr(reproduce, "rerun", fake_rerun)
    assert cli.main(["reproduce"], env={"RECIPE": "digits", "GPUS": "0"}) == code
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("digits top1, recorded on AMD EPYC, AVX512")
    assert len(out) == 5 and out[-1].startswith("bitwise: same hardware")


def test_overrides_are_refused_in_one_line(capsys):
    assert cli.main(["reproduce", "--", "seed=4"], env={}) == 2
    assert "leave ARGS unset" in capsys.readouterr().err
