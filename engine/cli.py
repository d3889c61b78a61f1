"""The engine's command line: `python -m engine.train RECIPE [--config VARIANT] [key=value ...]
[--spawn N]` (also `python -m engine`).

Exit codes: 0 done, 1 failure, 2 bad request (one line on stderr), 75 stopped on a
preemption signal with a checkpoint saved (rerun the same command to resume)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from engine import catalog, preempt, rundir
from engine import config as C
from engine import distributed as D
from engine.data.sampler import plan_batches
from engine.faults import RunError
from engine.setup import amp_dtype
from engine.spawn import spawn_local
from engine.tracking import redact, wandb_mode
from engine.train import PeerFailure, train

USAGE = "usage: python -m engine.train RECIPE [--config VARIANT] [key=value ...] [--spawn N]"


def _take_option(args: list[str], flag: str) -> str | None:
    """Remove `flag VALUE` from args and return VALUE (None when the flag is absent)."""
    if flag not in args:
        return None
    i = args.index(flag)
    if i + 1 >= len(args) or args[i + 1].startswith("-"):
        raise C.ConfigError(f"{flag} needs a value; {USAGE}")
    value = args[i + 1]
    del args[i : i + 2]
    return value


def parse_argv(argv: list[str]) -> tuple[str, str, list[str], int]:
    """(recipe, variant, overrides, spawn count)."""
    args = list(argv)
    spawn_text = _take_option(args, "--spawn")
    variant = _take_option(args, "--config") or ""
    try:
        spawn = int(spawn_text or 0)
    except ValueError:
        raise C.ConfigError(f"--spawn needs a process count; {USAGE}") from None
    if not args or args[0].startswith("-") or "=" in args[0]:
        raise C.ConfigError(
            f"no recipe given (available: {', '.join(catalog.available())}); {USAGE}"
        )
    return args[0], variant, args[1:], spawn


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.umask(os.umask(0) | 0o022)  # nothing the run writes is writable by others
    try:
        recipe_name, variant, overrides, spawn = parse_argv(argv)
        cfg, recipe = catalog.load_config(recipe_name, overrides, variant)
        denv = D.read_env()  # a half-set environment is a user error too
        preflight(cfg, spawn if spawn > 1 else denv.world_size)
        if spawn > 1:
            head = [recipe_name, *(["--config", variant] if variant else [])]
            name = cfg.run.name or rundir.new_run_name(recipe_name, variant)
            return spawn_local(spawn, main, head, overrides, name)
        preempt.install_handlers()
        return train(cfg, recipe)
    except C.ConfigError as err:
        if is_rank_zero():
            print(f"error: {redact(one_line(err))}", file=sys.stderr)  # all ranks fail alike
        return 2
    except RunError as err:
        if is_rank_zero() or isinstance(err, PeerFailure):
            print(f"error: {redact(str(err))}", file=sys.stderr, flush=True)
        return 1


def is_rank_zero() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def one_line(err: Exception) -> str:
    """The message itself: an error raised in a DataLoader worker arrives wrapped in the
    worker's traceback text, whose last line is `module.Type: message`."""
    last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    prefix = f"{type(err).__module__}.{type(err).__name__}: "
    return last.removeprefix(prefix).removeprefix(f"{type(err).__name__}: ")


def preflight(cfg: C.Config, world_size: int) -> None:
    """Checks that need the world size, done once before any process starts or writes."""
    plan_batches(cfg.train.batch_size, cfg.train.micro_batch_size, world_size)
    if cfg.device == "cpu":
        amp_dtype(cfg.train.amp, torch.device("cpu"))
    if cfg.run.name:
        run_dir = Path(cfg.run.root) / cfg.recipe / cfg.run.name
        rundir.check_fresh_start(run_dir, cfg.resume, cfg.run.overwrite)
    wandb_mode(cfg.log)


if __name__ == "__main__":
    sys.exit(main())
