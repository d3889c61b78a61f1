"""A checkpoint's files on disk: their names, and writes that are atomic (a crash leaves the old
file or the complete new one, never a torn file). Both kinds of checkpoint use these."""

from __future__ import annotations

import io
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

NAME = re.compile(r"step-(\d+)\.pt$")  # a single-file checkpoint
SHARDED_NAME = re.compile(r"^step-(\d+)$")  # a sharded checkpoint's directory
PARTIAL_SUFFIX = ".partial"  # `.step-<n>.partial`: a sharded checkpoint being written
OLD_SUFFIX = ".old"  # `.step-<n>.old`: a sharded checkpoint of the same step being replaced


def atomic_save(obj: Any, path: Path, pause_s: float = 0.0) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the target, so a
    crash leaves either the old file or the complete new one, never a torn file. pause_s
    stalls halfway through the bytes (fault tests: a process killed mid-write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if pause_s:
                _write_with_pause(obj, f, pause_s)
            else:
                _save_reporting_os_errors(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


class _WriteRecorder:
    """torch.save's zip writer turns a failed write (a full disk) into a RuntimeError about
    stream positions; this keeps the OSError so the error can say what really happened."""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def _save_reporting_os_errors(obj: Any, f) -> None:
    recorder = _WriteRecorder(f)
    try:
        torch.save(obj, recorder)
    except RuntimeError:
        if recorder.error is not None:
            raise recorder.error from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """A small file replaced whole or not at all (a full disk keeps the old one)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_with_pause(obj: Any, f, pause_s: float) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    time.sleep(pause_s)
    f.write(data[len(data) // 2 :])


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
