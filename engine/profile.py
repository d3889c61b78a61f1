"""What a run records about its own speed and memory when asked (the `prof` section): a
torch.profiler trace of optimizer steps A..B (`prof.steps=A:B`) on the ranks asked
(`prof.ranks`), with a summary beside it that `make report` reads, and on CUDA the caching
allocator's history (`prof.memory`), written as a snapshot at the end of the window, at the
end of the run and on an out-of-memory error.

The window runs on torch.profiler's schedule (one warm-up step before A where the run has one,
then A..B recorded) and each optimizer step is a `ProfilerStep#N` span, as Holistic Trace
Analysis and TensorBoard's profiler plugin split a trace into iterations (N counts from the
warm-up step); inside it, a `step <n>` span carries the run's own step number.

Everything lands in <run>/profile/: rank<r>-steps<A>-<B>.trace.json (Chrome's trace format:
chrome://tracing or ui.perfetto.dev), rank<r>-steps<A>-<B>.summary.json (the top operators by
self time, and the window's time in the loop's phases: data wait, forward, backward,
optimizer, as the loop marks them with record_function), rank<r>-memory.pickle (open it at
pytorch.org/memory_viz).

Profiling observes: it draws no random number and changes no kernel, so the losses and the
weights are bitwise those of a run without it (tests/engine/test_profile.py)."""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import record_function

from engine.config import ConfigError
from engine.tracking import log

PHASES = ("data wait", "forward", "backward", "optimizer")  # the loop's record_function names
TOP = 15  # operators in a summary
WARMUP_STEPS = 1  # profiled but not recorded before the window, where the run has them


NOT_RECORDING = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager:
    """The loop's phase as a record_function while a profiler records, else nothing: a
    record_function costs ~16 us a call with no profiler (measured on a CPU), and the loop
    marks four phases a step or more."""
    return record_function(name) if torch.autograd._profiler_enabled() else NOT_RECORDING


@dataclass(frozen=True)
class Window:
    first: int  # the first optimizer step recorded (1-based, as the logs count)
    last: int


def parse_steps(text: str) -> Window | None:
    """prof.steps: "" (off) or "A:B" with 1 <= A <= B."""
    if not text:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise ConfigError(
            f"prof.steps={text!r}: give the optimizer steps to record as A:B with 1 <= A <= B, "
            "e.g. prof.steps=10:12"
        )
    return Window(int(m[1]), int(m[2]))


def parse_ranks(text: str, world_size: int) -> set[int]:
    """prof.ranks: "all", or ranks separated by commas."""
    if text.strip() == "all":
        return set(range(world_size))
    try:
        ranks = {int(r) for r in text.split(",") if r.strip()}
    except ValueError:
        ranks = set()
    if not ranks or not all(0 <= r < world_size for r in ranks):
        raise ConfigError(
            f"prof.ranks={text!r}: give 'all' or ranks below the world size {world_size} "
            "separated by commas, e.g. prof.ranks=0,3"
        )
    return ranks


class Profiling:
    """The run's profiler and memory history; step_begins/step_ended bracket each optimizer
    step (the loop calls them), close() ends whatever is still recording."""

    def __init__(self, cfg, rank: int, world_size: int, run_dir: Path, device: torch.device):
        self.window = parse_steps(cfg.steps)
        self.folder, self.rank, self.device = Path(run_dir) / "profile", rank, device
        self.traced = self.window is not None and rank in parse_ranks(cfg.ranks, world_size)
        self.memory = cfg.memory and device.type == "cuda"
        self.profiler: torch.profiler.profile | None = None
        self.step_range: torch.profiler.record_function | None = None
        self.done = False  # the window was written (or passed): one per run
        self.last_step: int | None = None  # the last step the open window saw end
        if cfg.memory and device.type != "cuda" and rank == 0:
            log(f"note: prof.memory applies to CUDA only: no allocator history on {device.type}")
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    @property
    def active(self) -> bool:
        return self.traced or self.memory

    def step_begins(self, step: int) -> None:
        if self.traced and self.profiler is None and not self.done:
            if self.window.first - WARMUP_STEPS <= step <= self.window.last:
                self._open(step)
        if self.profiler is not None:  # the run's step number inside ProfilerStep#N
            self.step_range = torch.profiler.record_function(f"step {step}")
            self.step_range.__enter__()

    def _open(self, step: int) -> None:
        """A profiler on torch's schedule from this step: warm-up up to the window, then the
        window's steps recorded (from this one, in a run resumed inside the window)."""
        first, last = self.window.first, self.window.last
        self.folder.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # no warm-up step when the window starts the run
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(
                wait=0, warmup=max(0, first - step), active=last - max(step, first) + 1, repeat=1
            )
        self.profiler = torch.profiler.profile(
            activities=_activities(self.device),
            schedule=schedule,
            on_trace_ready=self._write_trace,
            record_shapes=True,
            profile_memory=True,
        )
        self.profiler.start()

    def step_ended(self, step: int) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.profiler is None:
            return
        self.last_step = step
        self.profiler.step()  # after the window's last step: the trace is written
        if step >= self.window.last:
            self._stop()
            if self.memory:
                self.write_memory()

    def write_memory(self) -> Path | None:
        """The allocator's history so far, as a snapshot file; None where none is kept."""
        if not self.memory:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}-memory.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def close(self) -> None:
        """The run ended (finished, stopped or failed): a window still open is written as
        far as it went; the memory snapshot of the whole run."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.profiler is not None:
            self.last_step = None  # the window did not reach its last step
            self._stop()  # writes what was recorded (torch calls _write_trace)
        if self.memory:
            self.write_memory()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False

    def _stop(self) -> None:
        profiler, self.profiler, self.done = self.profiler, None, True
        profiler.stop()

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        """on_trace_ready: the recorded steps' trace and summary."""
        first, last = self.window.first, self.last_step
        stem = f"rank{self.rank}-steps{first}-{last if last is not None else 'end'}"
        profiler.export_chrome_trace(str(self.folder / f"{stem}.trace.json"))
        summary = summarise(profiler, self.device) | {
            "rank": self.rank,
            "steps": [first, last],
            "trace": f"{stem}.trace.json",
        }
        (self.folder / f"{stem}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def _activities(device: torch.device) -> list:
    kinds = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        kinds.append(torch.profiler.ProfilerActivity.CUDA)
    return kinds


def summarise(profiler: torch.profiler.profile, device: torch.device) -> dict:
    """The top operators by self time (the device's where it has one, else the host's) and
    the phases' totals, in milliseconds."""
    averages = profiler.key_averages()
    on_device = device.type == "cuda"

    def self_ms(e) -> float:
        return (e.self_device_time_total if on_device else e.self_cpu_time_total) / 1000

    ops = [e for e in averages if e.key not in PHASES and not _is_step(e.key)]
    ops = [e for e in ops if not e.key.startswith("ProfilerStep#")]
    ops.sort(key=self_ms, reverse=True)
    phases = {}
    for e in averages:
        if e.key in PHASES:
            host = e.cpu_time_total / 1000
            phases[e.key] = {"host_ms": round(host, 3), "calls": e.count}
            if on_device:
                phases[e.key]["device_ms"] = round(e.device_time_total / 1000, 3)
    steps = [e for e in averages if _is_step(e.key)]
    return {
        "device": device.type,
        "time_basis": "device self time" if on_device else "host self time",
        # the traced steps' time: the host's wall time in them; on CUDA also the device's
        "steps_ms": round(sum(e.cpu_time_total for e in steps) / 1000, 3),
        "steps_device_ms": (
            round(sum(e.device_time_total for e in steps) / 1000, 3) if on_device else None
        ),
        "phases": phases,
        "top_ops": [
            {"name": e.key, "calls": e.count, "self_ms": round(self_ms(e), 3)} for e in ops[:TOP]
        ],
    }


def _is_step(key: str) -> bool:
    return re.fullmatch(r"step \d+", key) is not None
