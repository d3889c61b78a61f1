"""A sweep's plan: its name, folder and members (every cell of the grid, launch.grid, times
seeds 0..N-1, seed-major), made from a request or rebuilt from the sweep.json a launch
recorded. Running and recording the members: launch.sweep_members."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.rundir import decide_run_dir
from launch import grid, request
from launch.errors import UserError
from launch.render import LaunchRequest
from launch.runs import read_json

MANIFEST = "sweep.json"


@dataclass
class Planned:
    """A member: its cell, seed and the request that runs it."""

    cell: grid.Cell
    seed: int
    req: LaunchRequest


@dataclass
class Plan:
    req: LaunchRequest  # the sweep's own: run_name is the sweep's name
    grid: grid.Grid
    seeds: int
    parallel: int | None
    slurm: bool
    folder: Path  # <run root>/<recipe>/<name>-sweep
    members: list[Planned]
    named: bool = True  # False: the name was made up for this launch

    @property
    def rerun(self) -> str:
        """How to go on with this sweep: the same command, naming the sweep if it did not."""
        if self.named:
            return "rerun the same command"
        return f"rerun the same command with run.name={self.name} in ARGS"

    @property
    def name(self) -> str:
        return self.req.run_name

    def identity(self) -> dict[str, Any]:
        return {**self.grid.identity(), "recipe": self.req.recipe, "config": self.req.variant}


# ---------------------------------------------------------------- the plan


def report_dir(src: str, run_root: str, recipe: str, base: str) -> Path:
    """A sweep's folder sits beside its members' run directories (the same rule)."""
    return Path(src) / decide_run_dir(run_root, recipe, f"{base}-sweep")


def pick_int(args_value, flag: str, env: Mapping[str, str], var: str, fix: str) -> int | None:
    picked = request.pick(args_value, flag, env, var)
    return request.whole(*picked, 1, fix) if picked else None


def sweep_name(req: LaunchRequest, the_grid: grid.Grid, given: str | None) -> str:
    """ARGS' run.name, else the sweep file's name:, else a new time-stamped name."""
    if the_grid.name is not None:
        if not request.RUN_NAME.fullmatch(the_grid.name):
            raise UserError(
                f"SWEEP: name: {the_grid.name!r} is not a run name (letters, digits, . _ -)"
            )
        if given is not None and given != the_grid.name:
            raise UserError(
                f"run.name={given} but the sweep file names the sweep {the_grid.name}; give one"
            )
        return check_length(the_grid.name)
    return check_length(given or req.run_name)


def check_length(name: str) -> str:
    if len(name) > grid.MAX_NAME:
        raise UserError(
            f"the sweep's name is {len(name)} characters ({name[:40]}...); give a run.name of "
            f"at most {grid.MAX_NAME}"
        )
    return name


def recorded_seeds(folder: Path) -> int | None:
    old = read_json(folder / MANIFEST, [])
    return old.get("seeds") if old and isinstance(old.get("seeds"), int) else None


def members(req: LaunchRequest, the_grid: grid.Grid, seeds: int) -> list[Planned]:
    """Seed-major: every cell's seed 0, then every cell's seed 1, ..."""
    planned = []
    for seed in range(seeds):
        for cell in the_grid.cells:
            name = grid.member_name(req.run_name, cell, seed)
            overrides = (*the_grid.fixed, *cell.overrides, f"seed={seed}")
            planned.append(Planned(cell, seed, replace(req, run_name=name, overrides=overrides)))
    return planned


def make_plan(args: argparse.Namespace, env: Mapping[str, str]) -> Plan:
    asked = request.Asked.of(args, env)
    use_slurm = args.slurm or asked.target_or_local()[1] == "submit"
    req = request.resolve(asked, target="submit" if use_slurm else "local")
    own = tuple(o for o in req.overrides if o.partition("=")[0] not in ("seed", "run.name"))
    sweep_file = args.sweep or env.get("SWEEP") or None
    the_grid = grid.build(own, sweep_file, args.baseline or env.get("BASELINE") or None)
    given = request.run_name(req.overrides)
    name = sweep_name(req, the_grid, given)
    req = replace(req, run_name=name, overrides=own)
    folder = report_dir(req.src, req.run_root, req.recipe, name)
    seeds = pick_int(args.seeds, "--seeds", env, "SEEDS", "use e.g. SEEDS=5")
    seeds = seeds or the_grid.seeds or recorded_seeds(folder) or 3
    parallel = pick_int(args.parallel, "--parallel", env, "PARALLEL", "use e.g. PARALLEL=4")
    if parallel and not use_slurm:
        raise UserError(
            f"PARALLEL={parallel} limits a SLURM job array (TARGET=submit); a local sweep runs "
            "one member at a time"
        )
    parallel = parallel or the_grid.parallel
    named = the_grid.name is not None or given is not None
    planned = members(req, the_grid, seeds)
    return Plan(req, the_grid, seeds, parallel, use_slurm, folder, planned, named)


def replay(record: Mapping[str, Any], req: LaunchRequest, folder: Path) -> Plan:
    """The plan a sweep.json records (its grid rebuilt from the identity)."""
    ident = record.get("identity") or {}
    axes = tuple(
        grid.Axis(tuple(a["keys"]), tuple(tuple(p) for p in a["values"]))
        for a in ident.get("axes", [])
    )
    cells = grid.build_cells(axes, str(folder / MANIFEST))
    baseline = tuple((ident.get("baseline") or {}).items()) or cells[0].settings
    the_grid = grid.Grid(axes, tuple(ident.get("fixed", [])), baseline, cells=cells)
    base = replace(req, run_name=record["sweep"], overrides=tuple(ident.get("fixed", [])))
    seeds = int(record.get("seeds") or 1)
    return Plan(
        base, the_grid, seeds, record.get("parallel"), False, folder, members(base, the_grid, seeds)
    )
