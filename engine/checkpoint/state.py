"""What a checkpoint holds and how a run is restored from it.

A checkpoint holds the bare model and optimizer states (whole tensors in one file written by
rank 0, or each rank's shards in a sharded directory), and `meta`: the scheduler and scaler
states, the position in training, every rank's RNG states, the EMA and the config. Resuming
refuses a config change that would alter the run it continues."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from engine import checkpoint as ckpt
from engine import codeid
from engine import config as C
from engine import distributed as D
from engine.checkpoint import best
from engine.ema import ema_state, load_ema_state
from engine.faults import RunError, save_pause
from engine.parallel import Strategy
from engine.recipe import Recipe
from engine.run import Run, State
from engine.seeding import derive_seed, rng_state, seed_process, set_rng_state
from engine.tracking import log, redact


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(
    saved: dict, current: dict, also_safe: tuple[str, ...] = ()
) -> tuple[list[str], list[str]]:
    """(changes that alter the run, changes that keep it), each as 'key old -> new'; also_safe:
    the recipe's own keys that keep it (Recipe.resume_safe). A key on one side only is a
    field added or removed by a code update, at its default: not a change."""
    old, new = flatten(saved), flatten(current)
    safe_keys = C.resume_safe_keys() + also_safe  # declared beside each config field
    refused, allowed = [], []
    for key in sorted(old.keys() & new.keys()):
        if old[key] == new[key]:
            continue
        text = f"{key} {old[key]} -> {new[key]}"
        (allowed if key.startswith(safe_keys) else refused).append(text)
    return refused, allowed


def resume_source(cfg: C.Config, run_dir: Path) -> tuple[Path, dict] | None:
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        return ckpt.latest_valid(run_dir / "checkpoints")
    path = Path(cfg.resume)
    if path.is_file() and path.suffix != ".pt":  # .safetensors, .bin, .pth: weights only
        raise weights_only(path)
    try:
        state = ckpt.load(path)
    except (C.ConfigError, OSError):
        raise
    except Exception as err:  # not a torch file, or one holding objects weights_only refuses
        raise C.ConfigError(
            f"resume={path} is not a readable checkpoint ({ckpt.reason(err)})"
        ) from None
    if not isinstance(state, dict) or not {"step", "scheduler"} <= state.keys():
        raise weights_only(path)
    return path, state


def weights_only(path: Path) -> C.ConfigError:
    """resume= continues a training run; a file of weights alone starts one instead."""
    return C.ConfigError(
        f"resume={path} holds weights only (an export or published weights), not a training "
        f"checkpoint; start a run from them with model.init_from={path}"
    )


def check_resumable(
    cfg: C.Config,
    recipe: Recipe,
    strategy: Strategy,
    source: tuple[Path, dict],
    is_main: bool,
    code: dict,
) -> None:
    """Before any weights load: the config and the code continue the same run, and the
    checkpoint's format suits the strategy."""
    check_config_drift(cfg, recipe, source, is_main)
    check_code(cfg, source, code)
    check_format(strategy, source[0])


def check_code(cfg: C.Config, source: tuple[Path, dict], code: dict) -> None:
    """The code is the largest part of a request: a resume over other code (a new commit, a
    git pull, other uncommitted changes) would continue the run with another program, so it
    is refused unless run.allow_code_change says so (then recorded, engine.setup)."""
    saved = source[1].get("code")
    if saved is None or cfg.run.allow_code_change or codeid.same_code(saved, code):
        return  # None: a checkpoint written before checkpoints named their code
    raise C.ConfigError(
        f"checkpoint {source[0]} was written by other code ({codeid.difference(saved, code)}); "
        f"resuming would continue the run with another program: run the code it was "
        f"written with (git checkout {(saved.get('commit') or '?')[:12]}), or set "
        "run.allow_code_change=true to continue anyway (the change is recorded)"
    )


def check_config_drift(
    cfg: C.Config, recipe: Recipe, source: tuple[Path, dict], is_main: bool
) -> None:
    """Resuming continues one run: a change that alters it (batch, optimizer, schedule, data,
    model, seed) is refused; one that keeps its guarantees (logging, evaluation, length,
    checkpointing, workers, process count) is allowed and said."""
    saved = source[1].get("config")
    if saved is None:  # written before checkpoints carried their config
        return
    current = redact(cfg.to_dict())
    refused, allowed = config_changes(saved, current, recipe.resume_safe)
    if refused:
        raise C.ConfigError(
            f"checkpoint {source[0]} was written with another config ({', '.join(refused)}); "
            "resuming would change the run it continues: go back to those values, or start a "
            "new run with another run.name"
        )
    if allowed and is_main:
        log(f"resuming with changed settings that keep the run's guarantees: {', '.join(allowed)}")


def check_format(strategy: Strategy, path: Path) -> None:
    """A single-file checkpoint holds whole tensors keyed for one model: FSDP cannot take it
    (a sharded one loads anywhere)."""
    if path.is_dir() or not strategy.shards:
        return
    raise C.ConfigError(
        f"checkpoint {path} is a single file (written without dist.strategy=fsdp) and cannot "
        "be loaded sharded; resume it with the strategy that wrote it (e.g. dist.strategy=ddp)"
    )


def restore(run: Run, source: tuple[Path, dict]) -> State:
    """The optimizer, schedule, scaler, RNG and EMA states, and the position in training
    (the model's weights of a single file were loaded before wrapping)."""
    path, saved = source
    if path.is_dir():  # sharded: every rank reads the parts of the shards it now holds
        from engine.checkpoint import sharded  # start-up time: imports DCP

        sharded.load(path, run.bare, run.optimizer)
    else:
        run.optimizer.load_state_dict(saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    run.scaler.load_state_dict(saved["scaler"])
    if saved["world_size"] == run.denv.world_size:
        set_rng_state(saved["rng"][run.denv.rank])
    else:  # a different world size: fresh per-rank streams, still a function of the step
        seed_process(derive_seed(run.cfg.seed, saved["step"]), run.denv.rank)
    if run.ema is not None:
        if "ema" not in saved:
            raise C.ConfigError(
                f"checkpoint {path} holds no EMA of the weights, but ema.decay is set; "
                "resume with the config that wrote it (ema.decay=0) or start a new run"
            )
        load_ema_state(run.ema, saved["ema"])
    return State(
        saved["epoch"],
        saved["step"],
        saved["position"],
        saved.get("last_eval", {}),
        saved.get("bad_samples", 0),
        saved.get("skipped_steps", 0),
        saved.get("best", []),  # none in a checkpoint written before best checkpoints
    )


def save(run: Run) -> None:
    """A collective: every rank contributes its RNG state; rank 0 writes the single file (or
    every rank its shard), and every rank learns whether the checkpoint is complete (a failed
    write stops all of them, not one alone). The checkpoint carries the best checkpoints'
    ranking with itself ranked in (engine.checkpoint.best)."""
    best.select(run)
    rngs = D.gather_objects(rng_state())
    if run.strategy.fsdp:
        error = write_sharded(run, rngs)
    else:
        error = write_file(run, rngs) if run.denv.is_main else None
    if D.any_rank(error is not None, run.device):  # also the barrier: nobody leaves early
        raise RunError(error or "another rank could not write the checkpoint (see its error)")


def meta(run: Run, rngs: list) -> dict:
    """Everything in a checkpoint but the model and optimizer: position, schedule, RNGs."""
    st = run.state
    return {
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "epoch": st.epoch,
        "step": st.step,
        "position": st.position,
        "world_size": run.denv.world_size,
        "time": time.time(),  # when it was written: a restart reports the time it lost
        "rng": rngs,
        "last_eval": st.last_eval,
        "bad_samples": st.bad_samples,
        "skipped_steps": st.skipped_steps,
        "best": st.best,
        "config": redact(run.cfg.to_dict()),  # never a pasted credential
        "init": run.init_record,  # the first weights' file, recorded again by a resumed run
        "code": run.code,  # what a resume compares its own code with
    }


def write_file(run: Run, rngs: list) -> str | None:
    """Rank 0: the checkpoint file, then pruning, then the best checkpoints (a failure there
    is a warning); the error line when the disk refuses the checkpoint."""
    folder = run.run_dir / "checkpoints"
    path = ckpt.checkpoint_path(folder, run.state.step)
    payload = meta(run, rngs) | {
        "model": run.bare.state_dict(),
        "optimizer": run.optimizer.state_dict(),
    }
    if run.ema is not None:
        payload["ema"] = ema_state(run.ema)
    try:
        ckpt.atomic_save(payload, path, save_pause(run.cfg.fault, run.state.step))
        ckpt.prune(folder, run.cfg.ckpt.keep, path)
    except OSError as err:
        return write_error(run, path, err)
    best.place(run, path)
    return None


def write_sharded(run: Run, rngs: list) -> str | None:
    """Every rank: its shard of the model and optimizer, in a directory that is renamed into
    place once all shards and the metadata are written; rank 0 prunes and places the best."""
    folder = run.run_dir / "checkpoints"
    path = ckpt.sharded_path(folder, run.state.step)
    pause = save_pause(run.cfg.fault, run.state.step)
    from engine.checkpoint import sharded  # start-up time: imports DCP

    try:
        sharded.save(path, run.bare, run.optimizer, meta(run, rngs), pause)
        if run.denv.is_main:
            ckpt.prune(folder, run.cfg.ckpt.keep, path)
    except OSError as err:
        return write_error(run, path, err)
    if run.denv.is_main:
        best.place(run, path)
    return None


def write_error(run: Run, path: Path, err: OSError) -> str:
    folder = path.parent
    previous = [p.name for p in ckpt.list_checkpoints(folder) if p != path]
    intact = f"{previous[0]} is intact" if previous else "no earlier checkpoint exists"
    return (
        f"could not write checkpoint {path}: {err.strerror or err}; {intact}. Free space or "
        f"fix permissions under {run.run_dir.parent}, then rerun with "
        f"run.name={run.cfg.run.name} to resume"
    )
