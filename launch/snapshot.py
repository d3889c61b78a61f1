"""A snapshot of the code per submission: a job that waits in the queue, or is requeued a week
later, runs the code as it was when it was submitted, not whatever the checkout holds by then.

At submission the checkout's files (tracked ones as they are now, uncommitted changes
included, and untracked code git does not ignore: never data, runs or venvs) are copied,
read-only, to `<run dir>/code/<commit>[-<changes>]/` with their identity in CODE.json
(engine.codeid). The job keeps the checkout as its working directory, so relative paths
(run.root, data.root) mean what they meant, and imports only the snapshot: PYTHONPATH names
it and PYTHONSAFEPATH keeps the working directory off sys.path, in every process the job
starts (submitit's, srun's tasks, torchrun's workers). The default data root follows the
checkout through RECIPES_DATA. A later submission of other code gets a folder of its own: a
job still queued with the earlier snapshot is never changed under it.

The request is frozen the same way: the config the engine resolved at submission (recipe,
variant or CONFIG file, variables and ARGS) is written read-only to
`<run dir>/request/<content hash>.yaml`, and the job reads that file alone (`--resolved FILE
run.name=NAME`). A CONFIG file edited, deleted or left on the login node's /tmp after
`make submit` changes nothing queued; a requeue reads the same file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import shutil
import stat
import time
from pathlib import Path

from engine import codeid, rundir
from launch.errors import UserError
from launch.render import LaunchRequest

FOLDER = rundir.CODE_FOLDER  # under the run directory (engine.rundir names what is there)
REQUEST_FOLDER = rundir.REQUEST_FOLDER  # its submissions' frozen configs
# Without git (a copy of the checkout): the code's own folders and files.
CODE_PATHS = ("engine", "launch", "recipes", "bench", "pyproject.toml", "requirements.lock")
SKIPPED = ("__pycache__", ".pyc")
# A copy per submission on a shared filesystem: code is a few MB; more means a dataset or
# checkpoints sit in the checkout where git neither tracks nor ignores them.
MAX_BYTES = 200 * 2**20


def name_of(code: dict) -> str:
    """<commit 12>, or <commit 12>-<changes 8> for a checkout with uncommitted changes."""
    commit = (code.get("commit") or "nogit")[:12]
    changes = code.get("diff_sha256")
    return f"{commit}-{changes[:8]}" if changes else commit


def attach(req: LaunchRequest, base: str | None = None) -> LaunchRequest:
    """The request with the snapshot it runs from: `<base>/code/<name>`, base being its run
    directory (or a sweep's folder), relative to the checkout or absolute. Only reads git: a
    dry run shows the folder a submission would write."""
    base = req.run_dir if base is None else base
    folder = posixpath.join(base, FOLDER, name_of(codeid.identity(Path(req.src))))
    return dataclasses.replace(req, code=folder)


def freeze(req: LaunchRequest, config: str) -> LaunchRequest:
    """The request reading `config` (the engine's resolved text) from its frozen file,
    `<run dir>/request/<sha256 12>.yaml`: the same config, the same file. Writes nothing: a
    dry run shows the path a submission writes."""
    digest = hashlib.sha256(config.encode()).hexdigest()[:12]
    path = posixpath.join(req.run_dir, REQUEST_FOLDER, f"{digest}.yaml")
    return dataclasses.replace(req, frozen=path)


def write_frozen(req: LaunchRequest, config: str) -> Path | None:
    """The frozen config file of a request (freeze), whole or not at all, read-only; None for
    a request not frozen."""
    if not req.frozen:
        return None
    dest = Path(req.src) / req.frozen
    if dest.is_file() and dest.read_text() == config:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    partial.write_text(config)
    partial.chmod(0o444)
    os.replace(partial, dest)
    return dest


def files(src: Path) -> list[str]:
    """The checkout's files to copy, relative to it."""
    if codeid.is_checkout(src):
        out = codeid.git(src, "ls-files", "-z", "--cached")
        if out is None:
            raise UserError(f"git could not list the files of {src}; check `git status` there")
        names = [n for n in out.decode().split("\0") if n] + codeid.untracked(src)
    else:
        names = [
            str(p.relative_to(src))
            for top in CODE_PATHS
            for p in ([src / top] if (src / top).is_file() else sorted((src / top).rglob("*")))
        ]
    keep = (n for n in names if not any(part in n for part in SKIPPED))
    return sorted(n for n in keep if (src / n).is_file() or (src / n).is_symlink())


def take(req: LaunchRequest) -> Path:
    """Copies the checkout to the request's snapshot folder (once: the same code, the same
    folder) and returns it. Written under a temporary name and renamed, so a folder that
    exists is whole."""
    src = Path(req.src)
    dest = src / req.code
    if (dest / codeid.RECORD).is_file():
        return dest
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    identity = codeid.identity(src)
    names = files(src)
    check_size(src, names)
    for name in names:
        target = partial / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / name, target, follow_symlinks=False)
    record = identity | {"snapshot_of": str(src), "taken": time.strftime("%Y-%m-%d %H:%M:%S")}
    (partial / codeid.RECORD).write_text(json.dumps(record, indent=2) + "\n")
    read_only(partial)
    partial.rename(dest)
    return dest


def check_size(src: Path, names: list[str]) -> None:
    sizes = {n: (src / n).lstat().st_size for n in names}
    if sum(sizes.values()) <= MAX_BYTES:
        return
    largest = sorted(sizes, key=sizes.get, reverse=True)[:3]
    listed = ", ".join(f"{n} ({sizes[n] / 2**20:.0f} MB)" for n in largest)
    raise UserError(
        f"the code to snapshot for this job is {sum(sizes.values()) / 2**20:.0f} MB, over "
        f"{MAX_BYTES // 2**20} MB (largest: {listed}); move data and checkpoints under data/ "
        "or runs/, or add them to .gitignore; nothing was queued"
    )


def read_only(folder: Path) -> None:
    """Files read-only: an edit meant for the checkout cannot land in a job's code."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
