"""Where a window's time goes: host seconds spent in each stage of finishing a batch in this
process (decoding, augmenting, moving to the device), by whichever thread ran it (the
training thread, or the thread finishing batches ahead: engine.data.prefetch); on CUDA the
time the training stream stood waiting for a batch finished on another stream, and the
device time of the step's parts (forward and backward, optimizer), read from CUDA events
once the window's results are read back (no sync of its own).

Host seconds are what competes with the training thread for the interpreter; a stage's GPU
time runs asynchronously and shows up as the training stream's wait.

Loader workers (other processes) time their own stages of loading a sample (read, decode,
augment: WORKER_STAGES) into WORKER, their copy of which the training process never adds to,
and send the sums with each batch (worker_batch_seconds: three floats in the batch, no extra
process, no lock across processes); the training process logs their means per batch beside
data_wait. Loaded in the training process (loader.num_workers=0), the same stages go to
STAGES as the others.

One instance per process (STAGES): the stages run in dataset code that has no access to the
run, on two threads; a lock keeps the sums whole."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import torch


class StageTimes:
    def __init__(self):
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = defaultdict(float)
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] += seconds

    def timing(self, stage: str) -> Timed:
        return Timed(self, stage)

    def device_time(self, stage: str, device: torch.device) -> contextlib.AbstractContextManager:
        """The block's time on the device: on CUDA, between two events on the current stream
        (read at take(), after the window's read-back: no sync here); on the CPU, where the
        host computes, the host's."""
        if device.type != "cuda":
            return Timed(self, stage)
        return self._cuda_span(stage, device)

    @contextlib.contextmanager
    def _cuda_span(self, stage: str, device: torch.device) -> Iterator[None]:
        stream = torch.cuda.current_stream(device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        try:
            yield
        finally:
            after.record(stream)
            with self._lock:
                self._spans.append((stage, before, after))

    def stream_wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """stream.wait_event(event), bracketed by timing events on the stream: the time
        between them is the stream standing idle until the batch was finished."""
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        with self._lock:
            self._waits.append((before, after))

    def take(self) -> dict[str, float]:
        """The seconds per stage since the last take, and 'gpu_data_wait': the training
        stream's waits, in seconds. Call after the window's results were read back: the
        events recorded before them have completed."""
        with self._lock:
            seconds, self._seconds = self._seconds, defaultdict(float)
            waits, self._waits = self._waits, []
            spans, self._spans = self._spans, []
        spans += [("gpu_data_wait", a, b) for a, b in waits]
        if spans:
            torch.cuda.synchronize()  # done already after a read-back: no wait then
        for stage, before, after in spans:
            seconds[stage] += before.elapsed_time(after) / 1000
        return dict(seconds)


class Timed:
    """The host seconds of a `with` block, added to a stage. A class, not a generator
    context manager: the loop times two stages a step and a loader worker three a sample,
    and this costs ~2 us a use against ~7 (measured on a CPU)."""

    __slots__ = ("_times", "_stage", "_started")

    def __init__(self, times: StageTimes, stage: str):
        self._times, self._stage = times, stage

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self._times.add(self._stage, time.perf_counter() - self._started)


STAGES = StageTimes()

WORKER_STAGES = ("read", "decode", "augment")  # a sample's loading, as a loader worker times it
WORKER = StageTimes()  # a loader worker's stages since its last batch (empty in the trainer)


def sample_stage(stage: str) -> contextlib.AbstractContextManager:
    """Times one stage of loading a sample: in a loader worker into what its batch carries,
    in the training process into STAGES."""
    in_worker = torch.utils.data.get_worker_info() is not None
    return (WORKER if in_worker else STAGES).timing(stage)


def worker_batch_seconds() -> torch.Tensor | None:
    """In a loader worker: its seconds in each of WORKER_STAGES since the last batch (the
    batch just loaded), float64; None in the training process."""
    if torch.utils.data.get_worker_info() is None:
        return None
    seconds = WORKER.take()
    return torch.tensor([seconds.get(s, 0.0) for s in WORKER_STAGES], dtype=torch.float64)
