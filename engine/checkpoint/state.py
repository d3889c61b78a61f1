"""What a checkpoint holds and how a run is restored from it.

A checkpoint holds the bare model and optimizer states (whole tensors in one file written by
rank 0, or each rank's shards in a sharded directory), and the sum of the run's parts'
states (engine.parts: the schedule, the position, every rank's RNG states, the EMA, the
config, code and data fingerprints that wrote it), beside them in the file or as the
directory's meta.pt. Resuming refuses a config, code or data change that would alter the run
it continues."""

from __future__ import annotations

from pathlib import Path

from engine import checkpoint as ckpt
from engine import codeid
from engine import config as C
from engine import distributed as D
from engine.checkpoint import best
from engine.config.identity import config_changes
from engine.data import fingerprint
from engine.faults import RunError, save_pause
from engine.parallel import Strategy
from engine.recipe import Recipe
from engine.run import Run
from engine.tracking import log, redact


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
    data: dict | None = None,
) -> None:
    """Before any weights load: the config, the code and the data continue the same run,
    and the checkpoint's format suits the strategy."""
    check_config_drift(cfg, recipe, source, is_main)
    check_code(cfg, source, code)
    check_data(cfg, source, data or {})
    check_format(strategy, source[0])


def check_code(cfg: C.Config, source: tuple[Path, dict], code: dict) -> None:
    """The code is the largest part of a request: a resume over other code (a new commit, a
    git pull, other uncommitted changes) would continue the run with another program, so it
    is refused unless run.allow_code_change says so (then recorded, engine.assemble)."""
    saved = source[1].get("code")
    if saved is None or cfg.run.allow_code_change or codeid.same_code(saved, code):
        return  # None: a checkpoint written before checkpoints named their code
    raise C.ConfigError(
        f"checkpoint {source[0]} was written by other code ({codeid.difference(saved, code)}); "
        f"resuming would continue the run with another program: run the code it was "
        f"written with (git checkout {(saved.get('commit') or '?')[:12]}), or set "
        "run.allow_code_change=true to continue anyway (the change is recorded)"
    )


def check_data(cfg: C.Config, source: tuple[Path, dict], data: dict) -> None:
    """The data is the rest of a request: a resume over other data (a file added to a class
    folder, another corpus under the same path) would continue the run on other samples, so
    it is refused unless run.allow_data_change says so (then recorded, engine.assemble)."""
    saved = source[1].get("data")
    if not saved or cfg.run.allow_data_change:
        return  # none: a checkpoint written before checkpoints named their data
    change = fingerprint.difference(saved, data)
    if change is None:
        return
    raise C.ConfigError(
        f"checkpoint {source[0]} was written over other data ({change}); resuming would "
        "continue the run on other samples: restore the data it was trained on, or set "
        "run.allow_data_change=true to continue anyway (the change is recorded)"
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


def restore(run: Run, source: tuple[Path, dict]) -> None:
    """Every part's state from the checkpoint, and the optimizer's tensors as its format
    holds them (the model's of a single file were loaded before wrapping)."""
    path, saved = source
    if path.is_dir():  # sharded: every rank reads the parts of the shards it now holds
        from engine.checkpoint import sharded  # start-up time: imports DCP

        sharded.load(path, run.net.bare, run.opt.optimizer)
    else:
        run.opt.optimizer.load_state_dict(saved["optimizer"])
    try:
        run.load_state_dict(saved)
    except C.ConfigError as err:
        raise C.ConfigError(f"checkpoint {path} {err}") from None


def save(run: Run) -> None:
    """A collective: every rank contributes its RNG state; rank 0 writes the single file (or
    every rank its shard), and every rank learns whether the checkpoint is complete (a failed
    write stops all of them, not one alone). The checkpoint carries the best checkpoints'
    ranking with itself ranked in (engine.checkpoint.best). Under ckpt.async_save the
    checkpoint still being written is published first, then this one starts."""
    finish_writing(run)
    best.select(run)
    state = run.state_dict()  # a collective: the RNG states of every rank
    if run.net.strategy.fsdp:
        error = write_sharded(run, state)
    else:
        error = write_file(run, state) if run.denv.is_main else None
    if D.any_rank(error is not None, run.device):  # also the barrier: nobody leaves early
        raise RunError(error or "another rank could not write the checkpoint (see its error)")


def write_file(run: Run, state: dict) -> str | None:
    """Rank 0: the checkpoint file (the parts' states with the whole model and optimizer
    tensors), then pruning, then the best checkpoints (a failure there is a warning); the
    error line when the disk refuses the checkpoint."""
    folder = run.run_dir / "checkpoints"
    step = run.progress.step
    path = ckpt.checkpoint_path(folder, step)
    payload = state | {
        "model": run.net.bare.state_dict(),
        "optimizer": run.opt.optimizer.state_dict(),
    }
    try:
        ckpt.atomic_save(payload, path, save_pause(run.cfg.fault, step))
        ckpt.prune(folder, run.cfg.ckpt.keep, path)
    except OSError as err:
        return write_error(run, path, err)
    best.place(run, path)
    return None


def write_sharded(run: Run, state: dict) -> str | None:
    """Every rank: its shard of the model and optimizer, in a directory that is renamed into
    place once all shards and the parts' states (meta.pt) are written; rank 0 prunes and
    places the best."""
    folder = run.run_dir / "checkpoints"
    path = ckpt.sharded_path(folder, run.progress.step)
    pause = save_pause(run.cfg.fault, run.progress.step)
    from engine.checkpoint import sharded  # start-up time: imports DCP

    writer = run.held.writer
    try:
        if writer is not None:  # published, pruned and placed by finish_writing
            writer.start(path, run.net.bare, run.opt.optimizer, state, pause)
            return None
        sharded.save(path, run.net.bare, run.opt.optimizer, state, pause)
    except OSError as err:
        return write_error(run, path, err)
    return published(run, path)


def published(run: Run, path: Path) -> str | None:
    """Rank 0, once a sharded checkpoint is in place: pruning, then the best checkpoints (a
    failure there is a warning); the error line when pruning fails."""
    if not run.denv.is_main:
        return None
    try:
        ckpt.prune(path.parent, run.cfg.ckpt.keep, path)
    except OSError as err:
        return write_error(run, path, err)
    best.place(run, path)
    return None


def background_writer(cfg: C.Config, strategy: Strategy):
    """ckpt.async_save's writer (engine.checkpoint.sharded.BackgroundWriter), made on every
    rank at set-up (a collective); None: each checkpoint is written before training goes on."""
    if not (cfg.ckpt.async_save and strategy.fsdp):
        return None
    from engine.checkpoint import sharded  # start-up time: imports DCP

    return sharded.BackgroundWriter(cfg.dist.timeout_s)


def finish_writing(run: Run) -> None:
    """A collective under ckpt.async_save: wait for the checkpoint being written in the
    background, publish it, prune, place the best. Called before the next checkpoint and
    when training ends; a failed write ends the run in one line on every rank."""
    writer = run.held.writer
    if writer is None or writer.writing is None:
        return
    from engine.checkpoint.sharded import SaveFailed  # start-up time: imports DCP

    path = writer.writing.path
    try:
        writer.finish()
    except OSError as err:
        raise RunError(write_error(run, path, err)) from None
    except SaveFailed as err:  # not the disk's: said as it came
        raise RunError(f"could not write checkpoint {path}: {err}") from None
    error = published(run, path)
    if D.any_rank(error is not None, run.device):
        raise RunError(error or "another rank could not write the checkpoint (see its error)")


def write_error(run: Run, path: Path, err: OSError) -> str:
    folder = path.parent
    previous = [p.name for p in ckpt.list_checkpoints(folder) if p != path]
    intact = f"{previous[0]} is intact" if previous else "no earlier checkpoint exists"
    return (
        f"could not write checkpoint {path}: {err.strerror or err}; {intact}. Free space or "
        f"fix permissions under {run.run_dir.parent}, then rerun with "
        f"run.name={run.cfg.run.name} to resume"
    )
