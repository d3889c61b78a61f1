"""(e) memory_and_mfu: the GPU memory high-water mark (torch.cuda.max_memory_allocated) and
MFU of every measurement, gathered in one table. MFU = achieved training FLOP/s over the GPU's
dense bf16 datasheet peak in engine/speed.py (H100/H200: 989 TFLOP/s)."""

from __future__ import annotations

from bench.gpu.harness import Bench, device_peak

# Nested entries that are settings or compile counters, not a measured path.
NOT_PATHS = ("sizes", "torch_compile", "reference", "headline")


def throughput_rows(value, path: str, rows: list[dict]) -> None:
    """A row for every dict under `value` that has a throughput, named by its key path."""
    if not isinstance(value, dict):
        return
    if "img_per_s" in value or "tokens_per_s" in value:
        row = {"measurement": path}
        for key in ("img_per_s", "tokens_per_s", "mfu", "peak_memory_gb"):
            row[key] = value.get(key)
        rows.append(row)
    for k, v in value.items():
        if isinstance(v, dict) and k not in NOT_PATHS:
            throughput_rows(v, f"{path}.{k}", rows)


def memory_and_mfu(bench: Bench) -> dict:
    """One table of every path's memory high-water mark and MFU."""
    rows = []
    for name, entry in bench.result["measurements"].items():
        throughput_rows(entry, name, rows)
    _, source = device_peak(bench.device)
    out = {"peak": source, "rows": rows}
    if bench.device.type != "cuda":
        out["note"] = "CPU: no GPU memory high-water mark and no MFU"
    return out
