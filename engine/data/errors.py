"""Data errors. DataError is a user's problem with the data (missing folder, unreadable file):
one line naming the path and the fix, exit 2. BadSample marks one file that cannot be decoded;
the loader either turns it into a DataError or, with `data.skip_bad`, replaces and counts it."""

from __future__ import annotations

from engine.config import ConfigError


class DataError(ConfigError):
    """A problem with the dataset on disk, said in one line with the path and the fix."""


class BadSample(Exception):
    """One sample that cannot be read or decoded (not an image, truncated, unreadable)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason
