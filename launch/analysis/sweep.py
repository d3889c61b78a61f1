"""A sweep's judgement, and `python -m launch sweep` itself: the members planned and run by
launch.sweep_members, then the report of its cells from how every member stands (report.md,
report.json, chart.png; per cell the mean, std and 95% interval, each cell against the
baseline by Welch's t-test: launch.analysis.compare). `--report NAME` only rewrites a
sweep's report, from its sweep.json.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Mapping
from typing import Any

from launch import check, grid, request
from launch.analysis import cells as cell_stats
from launch.analysis import compare, report, stats
from launch.analysis.cells import CellResults
from launch.errors import UserError
from launch.runs import Member, read_json
from launch.sweep_members import SweepLock, dry_run, launch_members, outcome, standing
from launch.sweep_plan import MANIFEST, Plan, check_length, make_plan, replay, report_dir

# ---------------------------------------------------------------- the report


def report_cells(plan: Plan, found: list[Member]) -> list[CellResults]:
    by_cell: dict[str, CellResults] = {}
    base = plan.grid.baseline_cell().name
    for planned, member in zip(plan.members, found, strict=True):
        settings = {k: grid.canonical(v) for k, v in planned.cell.settings}
        name = planned.cell.name or plan.name
        cell = by_cell.setdefault(
            name, CellResults(name, settings, baseline=planned.cell.name == base)
        )
        cell.members.append(member)
    return list(by_cell.values())


def commits_text(record: Mapping[str, Any], envs: Mapping[str, dict]) -> str:
    """The launch's checkout, and the commits the finished members ran at where they differ."""
    git = record.get("git") or {}
    text = report.commit_text({"git_sha": git.get("sha"), "git_dirty": git.get("dirty")})
    shas = {report.commit_text(env) for env in envs.values() if env.get("git_sha")}
    if shas and shas != {text}:
        text += f"; members ran at {', '.join(sorted(shas))}"
    return text


def write_report(plan: Plan, record: dict[str, Any]) -> tuple[str, list[Member]]:
    found = standing(plan, record.get("attempts") or {})
    cells = report_cells(plan, found)
    finished = [m for m in found if m.finished]
    shape = " x ".join(str(len(a.points)) for a in plan.grid.axes) or "1"
    title = (
        f"Sweep {plan.name} ({plan.req.recipe}): {shape} cells x {plan.seeds} seeds, "
        f"{len(finished)} of {len(found)} members finished"
    )
    envs = {m.name: read_json(m.path / "env.json", []) or {} for m in finished}
    headline = compare.headline_of(finished or found, envs)
    kept = {
        k: record[k]
        for k in ("sweep", "recipe", "config", "grid", "seeds", "parallel", "command", "git")
    }
    kept["git_text"] = commits_text(record, envs)
    rep = compare.Report(title, headline, kept, plan.grid.keys, cell_stats.numeric_axis(cells))
    folder = plan.folder
    text = compare.write(
        cells, rep, folder / "report.md", folder / "report.json", folder / "chart.png"
    )
    return text, found


# ---------------------------------------------------------------- the command


def main(args: argparse.Namespace, env: Mapping[str, str], argv: list[str] | None = None) -> int:
    if args.report is not None:
        return report_only(args, env)
    plan = make_plan(args, env)
    if plan.slurm:  # before the engine's checks: a login node without submitit is told at once
        check.slurm_support()
    if request.is_dry(args, env):
        return dry_run(plan)
    stats.require_scipy()
    if plan.slurm:
        check.slurm_support().require_sbatch()
    with SweepLock(plan.folder):
        argv = argv if argv is not None else sys.argv[1:]
        record, stopped = launch_members(plan, env, argv, wait=not no_wait(args, env))
        text, found = write_report(plan, record)
    print(text, end="")
    print(
        f"report: {plan.folder / 'report.md'}, chart: {plan.folder / 'chart.png'}", file=sys.stderr
    )
    if stopped is not None:
        name = signal.Signals(stopped).name
        print(
            f"launch: sweep {plan.name} stopped by {name}; {plan.rerun} to go on",
            file=sys.stderr,
        )
        return 128 + stopped
    waiting = any(m.status == "queued" or not m.finished for m in found)
    held = any(m.status == "held" for m in found)
    if plan.slurm and no_wait(args, env) and waiting and not held:
        print(
            f"when they finish: python -m launch sweep --recipe {plan.req.recipe} --report {plan.name}",
            file=sys.stderr,
        )
        return 0
    return outcome(plan, found)


def no_wait(args: argparse.Namespace, env: Mapping[str, str]) -> bool:
    """--no-wait, or WAIT=0 (make sweep TARGET=submit WAIT=0): submit the array and return."""
    wait = env.get("WAIT", "").strip()
    if wait not in ("", "0", "1"):
        raise UserError(
            f"WAIT={wait!r}: 0 submits a sweep's array and returns, 1 (the default) waits"
        )
    return bool(args.no_wait) or wait == "0"


def report_only(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """--report NAME: the report of a sweep as it stands, from its sweep.json."""
    name = args.report
    if not request.RUN_NAME.fullmatch(name):
        raise UserError(f"--report={name!r} is not a sweep name; give the sweep's run.name")
    check_length(name)
    req = request.resolve(request.Asked.of(args, env), target="report")
    folder = report_dir(req.src, req.run_root, req.recipe, name)
    record = read_json(folder / MANIFEST, [])
    if not record:
        raise UserError(
            f"no sweep {name} in {folder.parent} (no {folder.name}/{MANIFEST}); check --report and RECIPE (runs without one: make compare RUNS=...)"
        )
    stats.require_scipy()
    plan = replay(record, req, folder)
    text, found = write_report(plan, record)
    print(text, end="")
    return outcome(plan, found)
