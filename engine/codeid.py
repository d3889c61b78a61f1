"""Which code a run runs: its commit, whether the checkout held changes, and a hash of them.

A job submitted to SLURM runs from a snapshot of the checkout taken at submission (launch's
snapshot module), which holds no git repository: the identity taken then is written beside
the code as CODE.json and read back here. A run started from the checkout itself computes it
from git. Torch-free: launch computes the same identity when it takes a snapshot."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORD = "CODE.json"  # a snapshot's identity, written when it was taken
IDENTITY = ("commit", "dirty", "diff_sha256")
CODE_SUFFIXES = (".py", ".yaml", ".yml", ".toml", ".json", ".cfg", ".ini", ".sh", ".lock")


def git(repo: Path, *args: str) -> bytes | None:
    """`git ARGS`'s output in repo, or None where git, the history or the checkout is
    missing (or git took over 20 s): the project's one place that runs git."""
    try:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_text(repo: Path, *args: str) -> str | None:
    """git(repo, ARGS) as stripped text."""
    out = git(repo, *args)
    return None if out is None else out.decode(errors="replace").strip()


def is_checkout(repo: Path) -> bool:
    """A git work tree whose top is `repo` itself: a snapshot inside a checkout's runs/
    folder is not one (git would answer for the checkout around it)."""
    top = git(repo, "rev-parse", "--show-toplevel")
    return top is not None and Path(top.decode().strip()).resolve() == repo.resolve()


def untracked(repo: Path) -> list[str]:
    """Code git does not track yet (a new module, a new config), never what it ignores (data,
    runs, venvs) nor files of other kinds (a job's slurm-N.out, notes): those change no run."""
    out = git(repo, "ls-files", "-z", "--others", "--exclude-standard") or b""
    return sorted(n for n in out.decode().split("\0") if n.endswith(CODE_SUFFIXES))


def diff_hash(repo: Path) -> str | None:
    """sha256 of the changes against HEAD: tracked files' diff, then each untracked file's
    name and bytes; None for a clean checkout."""
    diff = git(repo, "diff", "HEAD", "--binary") or b""
    extra = untracked(repo)
    if not diff and not extra:
        return None
    digest = hashlib.sha256(diff)
    for name in extra:
        path = repo / name
        if path.is_symlink():  # git records a link as its target
            digest.update(b"\0" + name.encode() + b"\0" + os.readlink(path).encode())
        elif path.is_file():
            digest.update(b"\0" + name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def from_git(repo: Path) -> dict | None:
    if not is_checkout(repo):
        return None
    sha = git(repo, "rev-parse", "HEAD")
    if sha is None:
        return None
    changes = diff_hash(repo)
    return {"commit": sha.decode().strip(), "dirty": changes is not None, "diff_sha256": changes}


def identity(repo: Path = REPO) -> dict:
    """{commit, dirty, diff_sha256} of the code in `repo` (a snapshot's CODE.json also names
    where it was taken from and when); an image without git names its commit in
    RECIPES_GIT_SHA."""
    record = repo / RECORD
    if record.is_file():  # the code's identity alone: where and when it was copied aside
        saved = json.loads(record.read_text())
        return {key: saved.get(key) for key in IDENTITY}
    found = from_git(repo)
    if found is not None:
        return found
    return {"commit": os.environ.get("RECIPES_GIT_SHA"), "dirty": None, "diff_sha256": None}


def same_code(a: dict, b: dict) -> bool:
    return a.get("commit") == b.get("commit") and a.get("diff_sha256") == b.get("diff_sha256")


def describe(code: dict) -> str:
    """'1a2b3c4d' or '1a2b3c4d with uncommitted changes 9f8e7d6c'."""
    commit = (code.get("commit") or "an unknown commit")[:12]
    if code.get("diff_sha256"):
        return f"{commit} with uncommitted changes {code['diff_sha256'][:8]}"
    return commit


def difference(old: dict, new: dict) -> str:
    """What changed between two identities, in words."""
    if old.get("commit") != new.get("commit"):
        return f"commit {describe(old)} -> {describe(new)}"
    before, after = (c.get("diff_sha256") or "none" for c in (old, new))
    commit = (old.get("commit") or "unknown")[:12]
    return f"commit {commit}, uncommitted changes {before[:8]} -> {after[:8]}"
