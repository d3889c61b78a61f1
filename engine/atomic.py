"""Files replaced whole or not at all: a crash leaves the old file or the complete new one,
never a torn file (checkpoints, config.yaml, env.json, summary.json, metrics)."""

from __future__ import annotations

import io
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError


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


def write_out(path: Path, text: str, variable: str = "OUT") -> None:
    """A result file at a path the user chose (make eval's OUT), replaced whole or not at all;
    a path that cannot be written is one line (ConfigError) naming it and the reason, with
    nothing left behind, never a traceback."""
    try:
        atomic_write_text(path, text)
    except OSError as err:
        raise ConfigError(unwritable(path, err, variable)) from None


def unwritable(path: Path | str, err: OSError, variable: str = "OUT") -> str:
    """The one line for a path the user chose that cannot be written."""
    return f"cannot write {path} ({err.strerror or err}); choose another {variable}"


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


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable (the directory's own fsync)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
