"""torch.compile activity: dynamo's counters (frames, graphs, graph breaks) and its
recompilation log records, kept so that each measurement can report what compiled during it."""

from __future__ import annotations

import logging

import torch

RECOMPILES: list[str] = []


class _RecompileLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Recompiling function" in message:
            RECOMPILES.append(message)


def watch_recompiles() -> None:
    """Dynamo logs each recompilation with the guard that failed; keep those messages."""
    try:
        torch._logging.set_logs(recompiles=True)
    except Exception:  # a torch without the artifact: frames are still counted
        return
    logging.getLogger("torch._dynamo").addHandler(_RecompileLog())


def dynamo_snapshot() -> dict:
    try:
        from torch._dynamo.utils import counters  # optional: torch's private API
    except Exception:
        return {}
    return {
        "frames_compiled": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": dict(counters["graph_break"]),
        "recompiles": len(RECOMPILES),
    }


def dynamo_delta(before: dict, after: dict) -> dict:
    if not before or not after:
        return {}
    out = {k: after[k] - before[k] for k in ("frames_compiled", "graphs", "recompiles")}
    breaks = {
        reason: n - before["graph_breaks"].get(reason, 0)
        for reason, n in after["graph_breaks"].items()
        if n != before["graph_breaks"].get(reason, 0)
    }
    out["graph_breaks"] = sum(breaks.values())
    if breaks:
        out["graph_break_reasons"] = {k[:300]: v for k, v in breaks.items()}
    if after["recompiles"] > before["recompiles"]:
        out["recompile_reasons"] = [
            first_lines(m) for m in RECOMPILES[before["recompiles"] : after["recompiles"]][:10]
        ]
    return out if any(out.values()) else {}


def first_lines(message: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in message.splitlines()[:n])[:400]


def use_compile_backend(backend: str | None) -> None:
    """Smoke runs on CPU compile with a quick backend (dynamo's capture, guards and
    recompilations all run; inductor's code generation does not)."""
    if backend is None:
        return
    if hasattr(torch.compiler, "set_default_backend"):
        torch.compiler.set_default_backend(backend)
        return
    original = torch.compile

    def compile_with(*args, **kwargs):
        kwargs.setdefault("backend", backend)
        return original(*args, **kwargs)

    torch.compile = compile_with
