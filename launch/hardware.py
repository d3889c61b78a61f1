"""Whether runs ran on hardware that gives the same bits: env.json's "hardware" entry
(written by engine.hardware) compared field by field, torch-free.

The same config, seed and code give the same bits only on the same CPU model and
instruction set, CPU threads, BLAS, GPU, driver, CUDA, cuDNN, NCCL and torch; across them, results agree
only statistically (over seeds). A run recorded before env.json named its hardware is
"unknown", never an error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.hardware_keys import BITS, SAME_MACHINE  # the writer's names, torch-free

__all__ = ["BITS", "SAME_MACHINE", "describe", "differences", "differing", "note", "of", "text"]
UNKNOWN = "unknown"


def of(env: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """env.json's hardware entry, or None for a run that recorded none."""
    found = (env or {}).get("hardware")
    return found if isinstance(found, dict) else None


def text(value: Any) -> str:
    if value is None or value == []:
        return "none"
    return "+".join(map(str, value)) if isinstance(value, list) else str(value)


def differences(
    a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, fields: Sequence[str] = BITS
) -> list[str]:
    """The fields (of `fields`) in which two hardware entries differ; every field when
    either is unknown (None). A field one of them does not hold (recorded before it was a
    fact, such as cpu_threads) is not compared."""
    if a is None or b is None:
        return list(fields)
    return [f for f in fields if f in a and f in b and text(a.get(f)) != text(b.get(f))]


def differing(records: Sequence[Mapping[str, Any] | None]) -> dict[str, list[str]]:
    """Over the known records: each field that takes more than one value, with its values
    in the order they first appear."""
    known = [r for r in records if r is not None]
    found: dict[str, list[str]] = {}
    for field in BITS:
        values = list(dict.fromkeys(text(r.get(field)) for r in known if field in r))
        if len(values) > 1:
            found[field] = values
    return found


def describe(found: Mapping[str, list[str]]) -> str:
    """`cpu_capability AVX2 vs AVX512; torch 2.14.1 vs 2.11.0`."""
    return "; ".join(f"{field} {' vs '.join(values)}" for field, values in found.items())


def note(records: Sequence[Mapping[str, Any] | None]) -> str | None:
    """One line for runs that did not all run on the same hardware, else None."""
    unknown = sum(r is None for r in records)
    found = differing(records)
    also = f"; {unknown} of {len(records)} runs record no hardware ({UNKNOWN})" if unknown else ""
    if found:
        return (
            f"note: these runs ran on different hardware ({describe(found)}{also}): bitwise "
            "equality is not expected, only statistical agreement"
        )
    if unknown and unknown < len(records):
        return (
            f"note: {unknown} of {len(records)} runs record no hardware (run before env.json "
            "named it): whether they ran on the same hardware is unknown"
        )
    return None
