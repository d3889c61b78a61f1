"""Best checkpoints: the `ckpt.best` checkpoints with the best values of the task's headline
metric, kept in `<run dir>/best/` under their own names (`step-<n>.pt`, or `step-<n>/` for a
sharded one) and never pruned by `ckpt.keep`.

A checkpoint written at the step of the last evaluation is a candidate, with that
evaluation's headline value (the task says which metric and in which direction); ties keep
the earlier step. The ranking, [{step, value, file}] best first, is `Records.best`: every rank
computes it before the checkpoint is written, so the checkpoint carries it and a resumed run
continues it. After the write, rank 0 (holding the run directory's lock) makes best/ match
it: a missing file is hard-linked from the checkpoint of the same step (copied where links
are refused) under a hidden name and renamed into place; an entry whose checkpoint is gone
is dropped with a warning; anything else in best/ (evicted, from an abandoned continuation,
a dead writer's leftover) is removed. A failure here is a warning: the rolling checkpoints
are written and pruned before it and never touched by it."""

from __future__ import annotations

import errno
import math
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from engine.atomic import fsync_dir
from engine.checkpoint.files import checkpoint_path, list_checkpoints, sharded_path
from engine.results import summary_name
from engine.tracking import log

FOLDER = "best"


def folder(run_dir: Path) -> Path:
    return run_dir / FOLDER


# ---------------------------------------------------------------- ranking (every rank)


def ranked(entries: list[dict], candidate: dict | None, k: int, higher: bool) -> list[dict]:
    """The best k of the entries and the candidate (which replaces an entry of its step),
    best first; among equal values the earlier step ranks first, so a later one never
    displaces it."""
    pool = [e for e in entries if candidate is None or e["step"] != candidate["step"]]
    pool += [candidate] if candidate is not None else []
    return sorted(pool, key=lambda e: (-e["value"] if higher else e["value"], e["step"]))[:k]


def candidate(run, name: str) -> dict | None:
    """The checkpoint about to be written (its file or directory name) as an entry, when it
    follows an evaluation at the same step with a finite headline value."""
    last, step = run.records.last_eval, run.progress.step
    value = last.get(run.task.headline) if last.get("step") == step else None
    if not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return {"step": step, "value": float(value), "file": name}


def select(run) -> None:
    """Every rank, before the checkpoint is written: Records.best with this checkpoint ranked
    in. ckpt.best=0 leaves it as it is (nothing is ranked, written or removed)."""
    k = run.cfg.ckpt.best
    if k == 0:
        return
    folder_ = run.run_dir / "checkpoints"
    step = run.progress.step
    path = sharded_path(folder_, step) if run.net.strategy.fsdp else checkpoint_path(folder_, step)
    new = candidate(run, path.name)
    run.records.best = ranked(run.records.best, new, k, run.task.higher_is_better)


# ---------------------------------------------------------------- files (rank 0)


def place(run, written: Path | None = None) -> None:
    """Rank 0, after a checkpoint is written (`written`) or before summary.json: best/ made
    to match Records.best. Never raises for the files: a failure is a warning."""
    if run.cfg.ckpt.best == 0:
        return
    try:
        run.records.best = sync(run.run_dir, run.records.best, written.name if written else None)
    except OSError as err:
        log(
            f"warning: could not update {folder(run.run_dir)}: {err.strerror or err}"
            f"{f' ({err.filename})' if err.filename else ''}; the checkpoints are intact"
        )


def sync(run_dir: Path, entries: list[dict], fresh: str | None = None) -> list[dict]:
    """Make best/ hold exactly the entries' files; returns the entries it holds. `fresh`: the
    checkpoint just written, linked anew even if a file of that name is there (left by an
    abandoned continuation of the run)."""
    best, source = folder(run_dir), run_dir / "checkpoints"
    if not entries and not best.exists():
        return []
    best.mkdir(exist_ok=True)
    kept = []
    for entry in entries:
        name = entry["file"]
        if (best / name).exists() and name != fresh:
            kept.append(entry)
        elif (source / name).exists():
            link(source / name, best / name)
            kept.append(entry)
        else:
            log(
                f"warning: best checkpoint {name} (step {entry['step']}) is missing from "
                f"{best} and its checkpoint is gone; it leaves the best set"
            )
    names = {e["file"] for e in kept}
    # Checkpoints outside the set and hidden leftovers go; other files (an --eval result
    # written beside a best checkpoint) stay.
    ours = {p.name for p in list_checkpoints(best)}
    for path in best.iterdir():
        if path.name not in names and (path.name in ours or path.name.startswith(".")):
            _remove(path)
    fsync_dir(best)
    return kept


def link(src: Path, dst: Path) -> None:
    """dst as a hard link of the checkpoint src (a file, or a sharded directory linked file
    by file), placed by a rename: complete or absent."""
    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.tmp"
    try:
        if src.is_dir():
            tmp.mkdir()
            for path in sorted(src.rglob("*")):
                target = tmp / path.relative_to(src)
                if path.is_dir():
                    target.mkdir()
                else:
                    _link_or_copy(path, target)
            if dst.exists():
                aside = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.old"
                dst.rename(aside)
                _remove(aside)
            tmp.rename(dst)
        else:
            _link_or_copy(src, tmp)
            os.replace(tmp, dst)
    finally:
        if tmp.exists():
            _remove(tmp)


# A file system that refuses hard links (or best/ on another device): a copy instead.
NO_LINK = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as err:
        if err.errno not in NO_LINK:
            raise
        shutil.copy2(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------- reading


def summary(run) -> list[dict[str, Any]]:
    """Rank 0, for summary.json: the best checkpoints that are there, best first, as
    {step, <headline>, path relative to the run directory}."""
    place(run)
    metric = summary_name(run.task.headline)
    best = folder(run.run_dir)
    return [
        {"step": e["step"], metric: e["value"], "path": f"{FOLDER}/{e['file']}"}
        for e in run.records.best
        if (best / e["file"]).exists()
    ]


def ranking(best: Path, read_meta) -> list[tuple[Path, dict]]:
    """The best checkpoints in a best/ folder, best first, each with its entry. The ranking
    is the one the newest of them carries: every checkpoint still in the best set ranked
    among the best when it was written, so it is in that list (files since evicted are
    not there any more)."""
    present = list_checkpoints(best)
    if not present:
        return []
    entries = read_meta(present[0]).get("best") or []
    return [(best / e["file"], e) for e in entries if (best / e["file"]).exists()]
