"""A recipe's claimed results, read and rerun: the helpers of `make reproduce`, whose
command and verdict are launch.analysis.reproduce (above launching, which never imports the
analysis).

Reads recipes/<recipe>/results.yaml (the headline metric, each claimed run's exact request,
its overrides, and value, and the hardware they were measured on: cpu model, instruction
set, torch version, date, commit) and reruns each request here as a normal run under
runs/reproduce/, never beside the runs the README quotes.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.catalog import RESULTS_FILE
from engine.config import load_yaml
from engine.rundir import decide_run_name
from launch import render, request
from launch.errors import UserError

RUN_ROOT = "runs/reproduce"


@dataclass(frozen=True)
class Claim:
    overrides: tuple[str, ...]
    value: float


@dataclass(frozen=True)
class Claims:
    """A recipe's results.yaml."""

    recipe: str
    headline: str
    claims: tuple[Claim, ...]
    measured: dict[str, Any]  # cpu_model, cpu_capability, torch, date, commit
    config: str = ""


# ---------------------------------------------------------------- the results file


def results_path(recipe: str, env: Mapping[str, str]) -> Path:
    return request.recipes_dir(env) / recipe / RESULTS_FILE


def load(recipe: str, env: Mapping[str, str]) -> Claims:
    path = results_path(recipe, env)
    if not path.is_file():
        raise UserError(
            f"recipe {recipe} records no results to reproduce (no {path}); "
            "recipes with one: " + (", ".join(with_results(env)) or "none")
        )
    try:
        data = load_yaml(path.read_text())
        claims = tuple(
            Claim(tuple(map(str, c["overrides"])), float(c["value"])) for c in data["runs"]
        )
        measured = {
            k: str(v) if k in ("date", "commit") else v for k, v in data["measured"].items()
        }
        return Claims(
            recipe, str(data["headline"]), claims, measured, str(data.get("config") or "")
        )
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise UserError(f"{path} is not a results file ({type(err).__name__}: {err})") from None


def with_results(env: Mapping[str, str]) -> list[str]:
    return [r for r in request.recipe_names(env) if results_path(r, env).is_file()]


# ---------------------------------------------------------------- rerunning


def requests(claims: Claims, args: argparse.Namespace, env: Mapping[str, str]):
    """Each claim's request exactly as recorded, as a new run under runs/reproduce/: the
    user's flags and variables, but the claim's recipe, config and overrides alone."""
    env = {k: v for k, v in env.items() if k not in ("ARGS", "CONFIG", "RECIPE")}
    base = request.Asked.of(args, env)
    reqs = []
    for i, claim in enumerate(claims.claims):
        name = decide_run_name("", claims.recipe, f"claim{i}")  # the one naming rule
        own = (f"run.root={RUN_ROOT}", f"run.name={name}")
        asked = dataclasses.replace(
            base,
            recipe=("--recipe", claims.recipe),
            config=claims.config or "",
            extra=(*claim.overrides, *own),
        )
        reqs.append(request.resolve(asked, target="local"))
    return reqs


def rerun(req) -> Path:
    argv = render.local(req)
    print(f"+ {render.shell_join(argv)}", file=sys.stderr, flush=True)
    rc = subprocess.run(argv, cwd=request.ROOT, stdout=sys.stderr.fileno()).returncode
    run_dir = Path(req.src) / req.run_dir
    if rc != 0:
        raise UserError(f"the rerun {run_dir} failed (exit {rc}); see its train.log", code=1)
    return run_dir
