"""`make reproduce RECIPE=digits`: rerun the results a recipe's README claims and check them.

The claims are recipes/<recipe>/results.yaml: the headline metric, each claimed run's exact
request (its overrides) and value, and the hardware they were measured on (cpu model,
instruction set, torch version, date, commit). Each request is rerun here as a normal run
under runs/reproduce/ (never beside the runs the README quotes; launch.claims), then
judged:

- on the same machine (cpu model, cpu capability and torch as recorded): each run must give
  its recorded value to all its recorded digits, bit for bit;
- elsewhere: the mean over the reruns must agree with the recorded values' by the Welch
  t-test the sweeps use (launch.analysis.stats), p >= 0.05.

Prints one line per run and the verdict; exits 0 on agreement, 1 on disagreement, 2 (one
line) for a recipe without results.yaml. This machine's hardware is read from the reruns'
env.json (launch never imports torch)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch import claims as claimed
from launch import hardware, render, request
from launch.analysis import stats
from launch.claims import Claims
from launch.errors import UserError
from launch.runs import read_json


@dataclass(frozen=True)
class Verdict:
    agree: bool
    lines: tuple[str, ...]


# ---------------------------------------------------------------- the judgement


def decimals(value: float) -> int:
    """The digits after the point that a recorded value states (repr: as YAML read it)."""
    text = repr(value)
    return len(text.partition(".")[2]) if "e" not in text else 17


def same_digits(recorded: float, now: float | None) -> bool:
    return now is not None and round(now, decimals(recorded)) == recorded


def same_machine(measured: Mapping[str, Any], here: Mapping[str, Any] | None) -> list[str]:
    """The fields that make this another machine ([] on the machine the claims recorded)."""
    return hardware.differences(measured, here, hardware.SAME_MACHINE)


def run_lines(claims: Claims, now: Sequence[float | None]) -> list[str]:
    lines = []
    for claim, value in zip(claims.claims, now, strict=True):
        said = "equal" if same_digits(claim.value, value) else "differs"
        shown = "none (no summary.json)" if value is None else repr(value)
        lines.append(f"{' '.join(claim.overrides)}: recorded {claim.value!r}, now {shown} ({said})")
    return lines


def judge(claims: Claims, now: Sequence[float | None], here: Mapping[str, Any] | None) -> Verdict:
    """Bit for bit on the recorded machine, else by Welch's t-test over the runs."""
    lines = run_lines(claims, now)
    other = same_machine(claims.measured, here)
    if not other:
        agree = all(same_digits(c.value, v) for c, v in zip(claims.claims, now, strict=True))
        said = "agree" if agree else "DISAGREE: a run differs on the same hardware and software"
        return Verdict(agree, (*lines, f"bitwise: same hardware ({machine(here)}): {said}"))
    found = [v for v in now if v is not None]
    test = stats.welch(found, [c.value for c in claims.claims])
    agree = len(found) == len(now) and agrees(test)
    why = differs_text(claims.measured, here, other)
    said = "agree" if agree else "DISAGREE"
    p = f"Welch p={stats.pvalue_text(test.p)}"
    return Verdict(agree, (*lines, f"statistical: different hardware ({why}), {p}: {said}"))


def agrees(test: stats.Comparison) -> bool:
    if test.p is None:  # no spread on either side (or too few runs): only equal means agree
        return test.difference == 0
    return test.p >= stats.ALPHA


def machine(facts: Mapping[str, Any] | None) -> str:
    """The facts that make a machine the same one, those the record holds."""
    facts = facts or {}
    return ", ".join(hardware.text(facts[f]) for f in hardware.SAME_MACHINE if f in facts)


def differs_text(measured: Mapping[str, Any], here: Mapping[str, Any] | None, fields) -> str:
    if here is None:
        return "this machine's is unknown: the reruns recorded no hardware"
    return "; ".join(
        f"{f} {hardware.text(measured.get(f))} vs {hardware.text(here.get(f))}" for f in fields
    )


def read_run(run_dir: Path, headline: str) -> tuple[float | None, dict[str, Any] | None]:
    """(the run's headline value, its hardware) from summary.json and env.json."""
    summary = read_json(run_dir / "summary.json", []) or {}
    value = summary.get(headline)
    value = float(value) if isinstance(value, int | float) else None
    return value, hardware.of(read_json(run_dir / "env.json", []))


def judge_runs(claims: Claims, run_dirs: Sequence[Path]) -> Verdict:
    found = [read_run(d, claims.headline) for d in run_dirs]
    here = next((facts for _, facts in found if facts is not None), None)
    return judge(claims, [value for value, _ in found], here)


# ---------------------------------------------------------------- the command


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    if env.get("ARGS") or args.overrides:
        raise UserError("reproduce reruns the recorded requests exactly: leave ARGS unset")
    claims = claimed.load(request.recipe_name(request.Asked.of(args, env), ""), env)
    reqs = claimed.requests(claims, args, env)
    if request.is_dry(args, env):
        for req in reqs:
            print(render.shell_join(render.local(req)))
        return 0
    stats.require_scipy()
    verdict = judge_runs(claims, [claimed.rerun(req) for req in reqs])
    m = claims.measured
    print(
        f"{claims.recipe} {claims.headline}, recorded on {machine(m)} ({m.get('date')}, "
        f"commit {m.get('commit')}):"
    )
    print("\n".join(verdict.lines))
    return 0 if verdict.agree else 1
