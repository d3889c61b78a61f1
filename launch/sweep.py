"""Seed sweeps: N runs that differ only in `seed`, then a report of each run's summary.json
with mean ± sample standard deviation.

Seed i runs as `seed=i run.name=<base>-seed<i>`; the report lands in
`<run root>/<recipe>/<base>-sweep/report.md` and `report.json`, with `chart.png` beside them
(mean curves over seeds with a ±1 std band, and each seed's final headline metric). Locally the runs go one after
the other; with --slurm (or --target submit, TARGET=submit) they are one job array.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import results
from launch import charts, check, render, request
from launch.errors import UserError
from launch.render import Request
from launch.runs import find_headline, read_json, read_metrics

# The known columns first, in this order.
METRICS = ("top1", "top5", results.summary_name("loss"), "seconds", "steps", "world_size")


# ---------------------------------------------------------------- pure parts


def seed_requests(req: Request, seeds: int) -> list[Request]:
    """One request per seed; the user's own seed and run.name overrides give way."""
    keep = tuple(o for o in req.overrides if o.partition("=")[0] not in ("seed", "run.name"))
    return [
        replace(req, run_name=f"{req.run_name}-seed{i}", overrides=(*keep, f"seed={i}"))
        for i in range(seeds)
    ]


def report_dir(src: str, run_root: str, recipe: str, base: str) -> Path:
    return Path(src) / run_root / recipe / f"{base}-sweep"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def summarize(summaries: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric: mean and sample standard deviation (n - 1; None for a single run) over
    the metrics that are numbers in every summary, the known ones first."""
    if not summaries:
        return {}
    rows = list(summaries.values())
    keys = [*METRICS, *sorted(set(rows[0]) - set(METRICS))]
    stats = {}
    for key in keys:
        values = [row.get(key) for row in rows]
        if not all(_is_number(v) for v in values):
            continue
        std = statistics.stdev(values) if len(values) > 1 else None
        stats[key] = {"mean": statistics.fmean(values), "std": std, "n": len(values)}
    return stats


def fmt(value: Any, whole: bool = False) -> str:
    """Counts as integers (their mean and std with one decimal), large values with one
    decimal, fractions and losses with four."""
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.1f}" if whole or abs(value) >= 10 else f"{value:.4f}"


def report_markdown(
    recipe: str, base: str, runs: Mapping[int, tuple[str, dict]], chart: str | None = None
) -> str:
    stats = summarize({seed: summary for seed, (_, summary) in runs.items()})
    names = list(stats)
    lines = [
        f"# Seed sweep {base} ({recipe}): {len(runs)} seeds",
        "",
        "| seed | run | " + " | ".join(names) + " |",
        "|---:|---|" + "---:|" * len(names),
    ]
    for seed, (run, summary) in sorted(runs.items()):
        lines.append(f"| {seed} | {run} | " + " | ".join(fmt(summary[m]) for m in names) + " |")
    cells = []
    for m, s in stats.items():  # std in the mean's precision
        one = all(isinstance(summary[m], int) for _, summary in runs.values())
        one = one or abs(s["mean"]) >= 10
        cells.append(f"{fmt(s['mean'], one)} ± {fmt(s['std'], one)}")
    lines += [
        "| mean ± std | | " + " | ".join(cells) + " |",
        "",
        f"Mean ± sample standard deviation (n - 1) over {len(runs)} seeds.",
        "",
    ]
    if chart:
        lines += [
            f"![Mean over seeds with a ±1 std band: training loss and the headline metric; "
            f"each seed's final headline metric]({chart})",
            "",
        ]
    return "\n".join(lines)


def read_summaries(run_dirs: Mapping[int, Path]) -> dict[int, tuple[str, dict]]:
    runs = {}
    for seed, folder in sorted(run_dirs.items()):
        path = folder / "summary.json"
        if not path.is_file():
            raise UserError(f"no {path}: seed {seed} has not finished; rerun it first", code=1)
        try:
            runs[seed] = (folder.name, json.loads(path.read_text()))
        except json.JSONDecodeError:
            raise UserError(f"{path} is not valid JSON; rerun seed {seed}", code=1) from None
    return runs


def mean_band(series: list[dict[int, float]]) -> charts.Band:
    """Mean and sample std over seeds at each step every seed recorded (a seed that stopped
    early shortens the curve rather than skewing its end)."""
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    columns = [[s[step] for s in series] for step in steps]
    std = [statistics.stdev(c) for c in columns] if len(series) > 1 else None
    return charts.Band(steps, [statistics.fmean(c) for c in columns], std)


def _values(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if _is_number(r.get(key))}


def sweep_chart(run_dirs: Mapping[int, Path], runs: Mapping[int, tuple[str, dict]]):
    """The chart's data from the seeds' metrics.jsonl and summary.json; what could not be read
    is said on stderr and left out."""
    metrics = {seed: read_metrics(folder / "metrics.jsonl") for seed, folder in run_dirs.items()}
    first = min(run_dirs)
    env = read_json(run_dirs[first] / "env.json", metrics[first].notes)
    headline = find_headline(runs[first][1] if first in runs else None, env, metrics[first].eval)
    key = headline.key
    for note in (n for m in metrics.values() for n in m.notes):
        print(f"launch: warning: {note}", file=sys.stderr)
    summaries = {seed: summary for seed, (_, summary) in runs.items()}
    stats = summarize(summaries).get(key, {})
    return charts.Sweep(
        headline=headline,
        loss=mean_band([_values(m.train, "loss") for m in metrics.values()]),
        metric=mean_band([_values(m.eval, headline.metric) for m in metrics.values()]),
        finals={s: v[key] for s, v in summaries.items() if _is_number(v.get(key))},
        mean=stats.get("mean"),
        std=stats.get("std"),
    )


def write_report(
    folder: Path,
    recipe: str,
    base: str,
    runs: Mapping[int, tuple[str, dict]],
    run_dirs: Mapping[int, Path] | None = None,
):
    """Writes report.md and report.json, and chart.png when the seeds' run directories are
    given; returns the markdown."""
    folder.mkdir(parents=True, exist_ok=True)
    chart = None
    if run_dirs:  # the numbers matter more than the picture: a chart failure is a warning
        title = f"Seed sweep {base} ({recipe}): {len(runs)} seeds"
        try:
            charts.draw_sweep(sweep_chart(run_dirs, runs), folder / "chart.png", title)
            chart = "chart.png"
        except (UserError, OSError) as err:
            print(f"launch: warning: no chart: {err}", file=sys.stderr)
    text = report_markdown(recipe, base, runs, chart)
    data = {
        "recipe": recipe,
        "base": base,
        "seeds": sorted(runs),
        "runs": {str(seed): {"run": run, "summary": s} for seed, (run, s) in sorted(runs.items())},
        "metrics": summarize({seed: s for seed, (_, s) in runs.items()}),
        "std": "sample (n - 1)",
        "chart": chart,
    }
    (folder / "report.md").write_text(text)
    (folder / "report.json").write_text(json.dumps(data, indent=2) + "\n")
    return text


def existing_seeds(parent: Path, base: str) -> dict[int, Path]:
    pattern = re.compile(re.escape(base) + r"-seed(\d+)")
    found = {}
    for folder in parent.glob(f"{base}-seed*"):
        match = pattern.fullmatch(folder.name)
        if match and folder.is_dir():
            found[int(match.group(1))] = folder
    return found


# ---------------------------------------------------------------- running a sweep


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def group_environ(base: str) -> dict[str, str]:
    """The seeds share one W&B group, the sweep's name, unless WANDB_RUN_GROUP is set."""
    return {"WANDB_RUN_GROUP": os.environ.get("WANDB_RUN_GROUP") or base}


def run_local(reqs: list[Request], dry: bool, environ: dict[str, str] | None = None) -> None:
    for i, r in enumerate(reqs):
        argv = render.local(r)
        if dry:
            print(render.shell_join(argv))
            continue
        print(f"+ {render.shell_join(argv)}", file=sys.stderr, flush=True)
        env = {**os.environ, **(environ or {})}
        rc = subprocess.run(argv, cwd=request.ROOT, env=env).returncode
        if rc != 0:
            base = r.run_name.rsplit("-seed", 1)[0]
            raise UserError(
                f"seed {i} ({r.run_name}) exited with code {rc}; the report needs every seed: "
                f"rerun with ARGS='run.name={base} ...' to resume the sweep",
                code=_exit_code(rc),
            )


def run_slurm(reqs: list[Request], folder: Path, base: str, wait: bool) -> bool:
    environ = group_environ(base)
    jobs = check.slurm_support().submit_array(reqs, folder / "slurm", base, environ)
    for r, job in zip(reqs, jobs, strict=True):
        print(f"submitted {job.job_id}: {r.run_name}  (log {job.paths.stdout})")
    if not wait:
        return False
    for r, job in zip(reqs, jobs, strict=True):
        try:
            job.result()
        except Exception as e:  # submitit re-raises the job's failure here
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{r.run_name} (job {job.job_id}) failed: {first}", code=1) from None
    return True


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    use_slurm = args.slurm or request.pick_target(args, env)[1] == "submit"
    if args.report is not None:
        if not request.RUN_NAME.fullmatch(args.report):
            raise UserError(f"--report={args.report!r} is not a run name; give the sweep's BASE")
        req = request.resolve(args, env, target="report")
        return report_only(req, args.report)
    picked = request.pick(args.seeds, "--seeds", env, "SEEDS") or ("SEEDS", "3")
    seeds = request.whole(*picked, 1, "use e.g. SEEDS=5")
    req = request.resolve(args, env, target="submit" if use_slurm else "local")
    reqs = seed_requests(req, seeds)
    base = req.run_name
    folder = report_dir(req.src, req.run_root, req.recipe, base)
    if request.is_dry(args, env):
        if use_slurm:  # the one job array submitit would submit
            print(check.slurm_support().dry_run(reqs, folder / "slurm", base), end="")
        else:
            run_local(reqs, dry=True)
        return 0
    if use_slurm:
        check.slurm_support().require_sbatch()
    check.engine_check(reqs[0], data_here=not use_slurm)  # seeds differ in seed and name
    if use_slurm:
        if not run_slurm(reqs, folder, base, wait=not args.no_wait):
            print(f"when they finish: python -m launch sweep --recipe {req.recipe} --report {base}")
            return 0
    else:
        run_local(reqs, dry=False, environ=group_environ(base))
    run_dirs = {i: Path(req.src) / r.run_dir for i, r in enumerate(reqs)}
    runs = read_summaries(run_dirs)
    print(write_report(folder, req.recipe, base, runs, run_dirs), end="")
    print(f"report: {folder / 'report.md'}, chart: {folder / 'chart.png'}", file=sys.stderr)
    return 0


def report_only(req: Request, base: str) -> int:
    parent = Path(req.src) / req.run_root / req.recipe
    found = existing_seeds(parent, base)
    if not found:
        raise UserError(f"no runs named {base}-seed<i> in {parent}; check --report and RECIPE")
    folder = report_dir(req.src, req.run_root, req.recipe, base)
    print(write_report(folder, req.recipe, base, read_summaries(found), found), end="")
    return 0
