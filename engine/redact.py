"""Credentials from the environment, kept out of everything a run or a launch records: any
variable whose name looks like one (KEY, TOKEN, SECRET, ...) has its value replaced by
`<redacted NAME>` wherever it appears, a key pasted into an override included. No torch here:
launch, which never imports torch, records commands with it too."""

from __future__ import annotations

import os
from typing import Any

CREDENTIAL_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
MIN_SECRET_CHARS = 8  # shorter values ("1", "true") would blank out unrelated text


def credentials_in_environment() -> dict[str, str]:
    """value -> variable name, for each variable whose name looks like a credential."""
    found = {
        value: name
        for name, value in os.environ.items()
        if any(word in name.upper() for word in CREDENTIAL_WORDS) and len(value) >= MIN_SECRET_CHARS
    }
    return dict(sorted(found.items(), key=lambda item: -len(item[0])))  # longest first


def redact(value: Any) -> Any:
    """`value` with every credential from the environment replaced by `<redacted NAME>`, in
    strings and inside lists, tuples and dicts (a user may paste a key into an override)."""
    return _redact(value, credentials_in_environment())


def _redact(value: Any, found: dict[str, str]) -> Any:
    if isinstance(value, str):
        for secret, name in found.items():
            value = value.replace(secret, f"<redacted {name}>")
        return value
    if isinstance(value, dict):
        return {k: _redact(v, found) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redact(v, found) for v in value)
    return value
