"""How a run's results are named: the evaluation records' metrics and summary.json's keys.

Torch-free: launch reads results with the same names the engine writes them."""

from __future__ import annotations

from typing import Any

# An evaluation record's "loss" is "eval_loss" in summary.json, beside the training loss.
SUMMARY_NAMES = {"loss": "eval_loss"}


def summary_name(metric: str) -> str:
    """An evaluation metric's key in summary.json."""
    return SUMMARY_NAMES.get(metric, metric)


def eval_name(key: str) -> str:
    """A summary.json key's name in the evaluation records."""
    return next((m for m, s in SUMMARY_NAMES.items() if s == key), key)


def task_facts(headline: str, higher_is_better: bool, unit: str) -> dict[str, Any]:
    """What launch needs to judge a run, written to env.json at the start (as "task") and to
    summary.json at the end: the headline metric's summary key and its direction."""
    return {"headline": summary_name(headline), "higher_is_better": higher_is_better, "unit": unit}


def headline(summary: dict[str, Any] | None, env: dict[str, Any] | None) -> tuple[str, bool] | None:
    """(the headline's summary key, higher is better) from summary.json, else from env.json's
    "task"; None for a run that recorded neither (written before they carried it)."""
    for source in (summary or {}, (env or {}).get("task") or {}):
        if isinstance(source.get("headline"), str):
            return source["headline"], bool(source.get("higher_is_better", True))
    return None


# Metrics the training log writes as percentages (engine.tasks: `top1 98.89%`): every status
# line, table and report shows them in that one unit.
PERCENT = ("top1", "top5")


def metric_text(key: str, value: float, signed: bool = False) -> str:
    """A metric's value as the training log writes it: top-1 as 98.89%, a loss as 0.1234."""
    sign = "+" if signed else ""
    if key in PERCENT:
        return f"{100 * value:{sign}.2f}%"
    return f"{value:{sign}.4f}" if abs(value) < 100 else f"{value:{sign}.1f}"
