"""A checkpoint's files on disk: their names and how they are listed, for both kinds."""

from __future__ import annotations

import re
from pathlib import Path

NAME = re.compile(r"step-(\d+)\.pt$")  # a single-file checkpoint
SHARDED_NAME = re.compile(r"^step-(\d+)$")  # a sharded checkpoint's directory
PARTIAL_SUFFIX = ".partial"  # `.step-<n>.partial`: a sharded checkpoint being written
OLD_SUFFIX = ".old"  # `.step-<n>.old`: a sharded checkpoint of the same step being replaced


def checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}.pt"


def sharded_path(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}"


def partial_path(path: Path) -> Path:
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


def old_path(path: Path) -> Path:
    return path.parent / f".{path.name}{OLD_SUFFIX}"


def _match(path: Path) -> re.Match | None:
    return SHARDED_NAME.search(path.name) if path.is_dir() else NAME.search(path.name)


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in the folder, files and directories alike, newest (highest step) first.
    A sharded checkpoint still being written is a hidden `.step-<n>.partial`: never listed."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p.name, p) for p in folder.iterdir() if (m := _match(p))]
    return [p for _, _, p in sorted(found, reverse=True)]


def step_of(path: Path) -> int:
    return int((NAME.search(path.name) or SHARDED_NAME.search(path.name)).group(1))
