"""Evaluate only: `python -m engine.train RECIPE --eval PATH [--ema] [--out FILE]`
(`make eval RECIPE=... CKPT=...`).

Scores a checkpoint (file, sharded folder, run folder: its newest valid one), an export, or
foreign weights (anything model.init_from reads, which must fit the model exactly) on the
recipe's held-out split, with the training loop's own evaluation: each sample once over any
number of processes, the same metrics. The result goes to a JSON file beside the weights
(`<name>[.ema].eval.json`, or --out), never into a training run's records."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from engine import atomic
from engine import config as C
from engine import distributed as D
from engine import recipe as contract
from engine.assemble import setup_eval
from engine.checkpoint.files import NAME, SHARDED_NAME
from engine.evaluate import evaluate
from engine.recipe import Recipe
from engine.seeding import set_deterministic
from engine.tracking import log
from engine.weights import files as weight_files


def target(path: Path) -> Path:
    """The weights evaluated: the path, a run folder's newest valid checkpoint, or the best
    one of a run's best/ folder."""
    if not path.exists():
        raise C.ConfigError(f"--eval {path}: no such file or folder")
    return weight_files.newest(path)


def result_path(weights: Path, ema: bool, out: str) -> Path:
    if out:
        return Path(out)
    stem = weights.name if weights.is_dir() else weights.stem
    return weights.parent / f"{stem}{'.ema' if ema else ''}.eval.json"


def for_scoring(cfg: C.Config, weights: Path, ema: bool) -> None:
    """The config with the weights as the model's only source, matched exactly: a resumed
    state or a re-initialised head would score something else. Nothing trains (setup_eval
    builds no optimizer and splits no training batch)."""
    derived = {"resume": "none", "ema.decay": 0.0}  # the EMA, if asked for, is what is loaded
    derived |= {"model.init_from": str(weights), "model.weights": "", "model.init_ema": ema}
    derived |= {"model.init_strict": True, "model.init_skip": []}
    C.finalize(cfg, derived)


def score(cfg: C.Config, recipe: Recipe, path: Path, ema: bool, out: str) -> int:
    """One process's part of an evaluation; rank 0 writes the result."""
    started = time.perf_counter()
    weights = target(path)
    destination = result_path(weights, ema, out)
    denv = D.read_env()
    for_scoring(cfg, weights, ema)
    D.limit_threads(denv)
    set_deterministic(cfg.deterministic)
    device = D.pick_device(cfg.device, denv)
    D.init(denv, cfg.dist, device)
    run = None
    try:
        run = setup_eval(cfg, recipe, denv, device)
        metrics = evaluate(run, run.net.eval_model)
        if denv.is_main:
            found = result(cfg, run.net.init_record, weights, ema, metrics, denv.world_size)
            found["seconds"] = time.perf_counter() - started
            atomic.write_out(destination, json.dumps(found, indent=2) + "\n")
            log(f"{cfg.recipe} {weights}: {run.task.describe(metrics)}; wrote {destination}")
        return 0
    finally:
        if run is not None:
            run.close()
        run = None  # the wrapped model holds the process group: dropped before it is destroyed
        D.shutdown()


def result(
    cfg: C.Config, init: dict, weights: Path, ema: bool, metrics: dict, world_size: int
) -> dict[str, Any]:
    name = NAME.search(weights.name) or SHARDED_NAME.search(weights.name)
    return {
        "recipe": cfg.recipe,
        "variant": cfg.variant,
        "weights": str(weights),
        "sha256": init["sha256"],
        "format": init["format"],
        "ema": ema,
        "step": int(name.group(1)) if name else None,
        "world_size": world_size,
        "eval": dataclasses.asdict(cfg.eval),
        **preprocessing(cfg),
        "metrics": metrics,
    }


def preprocessing(cfg: C.Config) -> dict[str, Any]:
    """An image recipe's evaluation resize and crop, which the metrics depend on."""
    augment = contract.augment(cfg.data)
    if not dataclasses.is_dataclass(augment):
        return {}
    keys = ("eval_resize", "eval_size", "interpolation")
    return {"preprocessing": {k: getattr(augment, k) for k in keys if hasattr(augment, k)}}
