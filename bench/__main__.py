"""Every benchmark in one run: `python -m bench` (or `make bench`); `--quick` for a short
version, `--out DIR` for where results.json and chart.png go (default runs/bench/<time>/).

Each benchmark reports ratios against a baseline measured in the same run (higher is better);
the table gives each with its target and PASS or below. A benchmark that fails is reported
in one line and the others still run; the exit code is then 1 (2: a bad request, such as an
--out folder that cannot be made). Ratios below their targets are findings, not failures:
the exit code stays 0."""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from engine import codeid

BENCHMARKS = ("decode", "overhead", "host_step", "end_to_end", "startup")  # decode: when it exists
REPO = Path(__file__).resolve().parent.parent
VERSIONS = ("torch", "torchvision", "numpy", "pillow", "matplotlib")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter segments")
    parser.add_argument("--out", type=Path, help="output folder (default runs/bench/<time>/)")
    # Smaller still than --quick, for the test that runs every benchmark: not a measurement.
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def available() -> list[str]:
    return [name for name in BENCHMARKS if importlib.util.find_spec(f"bench.{name}")]


def call(name: str, quick: bool, smoke: bool) -> list[dict]:
    """The benchmark's run(); smoke where it offers it, else its quick version."""
    run = importlib.import_module(f"bench.{name}").run
    if smoke and "smoke" in inspect.signature(run).parameters:
        return run(quick=True, smoke=True)
    return run(quick=quick or smoke)


def run_all(quick: bool, smoke: bool) -> tuple[list[dict], dict[str, float], list[dict]]:
    """(results, seconds per benchmark, errors)."""
    results, seconds, errors = [], {}, []
    for name in available():
        print(f"running {name} ...", flush=True)
        started = time.perf_counter()
        try:
            rows = call(name, quick, smoke)
        except Exception as err:  # one benchmark's failure must not lose the others' results
            line = (str(err).strip().splitlines() or [type(err).__name__])[-1]
            errors.append({"benchmark": name, "error": f"{type(err).__name__}: {line}"})
            print(f"error: {name}: {errors[-1]['error']}", file=sys.stderr, flush=True)
            continue
        seconds[name] = round(time.perf_counter() - started, 1)
        results += [{"benchmark": name} | row for row in rows]
        print(f"  {name}: {len(rows)} results in {seconds[name]:.0f} s", flush=True)
    return results, seconds, errors


def git(*args: str) -> str | None:
    return codeid.git_text(REPO, *args)


def version(package: str) -> str | None:
    """The installed version, None when the package is not installed (matplotlib may not be)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(quick: bool, smoke: bool) -> dict:
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": {name: version(name) for name in VERSIONS},
        "torch_runtime": torch.__version__,
        "git_sha": git("rev-parse", "HEAD"),
        "git_dirty": None if dirty is None else bool(dirty),
        "quick": quick,
        "smoke": smoke,
        "load_average_start": os.getloadavg(),
    }


def status(row: dict) -> str:
    if row["target"] is None:
        return "-"
    return "PASS" if row["ratio"] >= row["target"] else "below"


def table(results: list[dict]) -> str:
    width = max([len(r["name"]) for r in results] + [9])
    head = f"{'benchmark':<{width}}  {'measured':>10}  {'baseline':>10}  {'unit':<14}  "
    lines = [head + f"{'ratio':>6}  {'target':>7}  status"]
    for r in results:
        baseline = "-" if r["baseline"] is None else f"{r['baseline']:.4g}"
        target = "-" if r["target"] is None else f">={r['target']:g}"
        lines.append(
            f"{r['name']:<{width}}  {r['measured']:>10.4g}  {baseline:>10}  {r['unit']:<14}  "
            f"{r['ratio']:>6.3f}  {target:>7}  {status(r)}"
        )
    return "\n".join(lines + [""] + [f"- {r['name']}: {r['note']}" for r in results])


def write(out: Path, report: dict) -> tuple[Path, Path | None]:
    """results.json, then chart.png (None, said in one line, without matplotlib)."""
    results_path = out / "results.json"
    results_path.write_text(json.dumps(report, indent=2) + "\n")
    title = (
        f"make bench{' --quick' if report['quick'] else ''}: {report['date']}, {report['host']}, "
        f"{report['cpu_count']} CPUs, {report['threads']} threads, torch {report['torch_runtime']}"
    )
    try:
        from bench import chart  # optional: matplotlib draws it; the results need none
    except ImportError as err:
        package = (err.name or "matplotlib").split(".")[0]
        print(
            f"warning: no chart: {package} is not installed (pip install matplotlib, or use "
            "the project's venv); the results are in results.json",
            file=sys.stderr,
        )
        return results_path, None
    return results_path, chart.draw(report["results"], out / "chart.png", title)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path("runs", "bench", time.strftime("%Y%m%d-%H%M%S"))
    try:  # made now: a place that cannot hold the report fails before minutes of measuring
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"error: cannot write the report to {out}: {err.strerror or err}", file=sys.stderr)
        return 2
    report = metadata(args.quick, args.smoke)
    started = time.perf_counter()
    results, seconds, errors = run_all(args.quick, args.smoke)
    report |= {"seconds": round(time.perf_counter() - started, 1), "seconds_each": seconds}
    report |= {"load_average_end": os.getloadavg(), "results": results, "errors": errors}
    print("\n" + table(results))
    results_path, chart_path = write(out, report)
    print(f"\nresults: {results_path}" + (f"\nchart:   {chart_path}" if chart_path else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
