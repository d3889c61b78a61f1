"""Batches finished on the device ahead of the step (`loader.decode_ahead`, for data.decode=gpu
on CUDA): a thread takes the next batches from the loader and finishes them
(`finish_on_device`: decode, crop, flip, normalise) on a CUDA stream of its own while the
training thread launches the current step, so the host waits neither for nvJPEG (its decode
synchronises the host) nor for the launches of the batch's augmentation.

What the loop sees does not change: the same Samples in the same order, each x the tensor
finish_on_device gives (wrapped in Finished, which Run.to_device takes as it is). Every random
draw happened in the loader workers, so a finished batch is a pure function of the batch, and
resume and determinism hold as before. The training stream waits for each batch's CUDA event
before using it, and the batch is recorded on that stream, so the caching allocator does not
hand its memory to the finishing stream while the step still reads it.

The loader's iterator is created on the training thread (where it reads the sampler and, for
evaluation, draws the workers' base seed) and consumed only by the thread. A thread is used
only with loader workers: without them the DataLoader loads the samples in the calling thread,
seeding torch's global CPU generator per sample, which the training thread also draws from
(data mixing); two threads would interleave those draws. An error raised by the loader or by
finishing (a DataError naming a file) is raised on the training thread, unchanged, when the
loop asks for the batch it belongs to. An iterator the loop leaves (end of epoch,
train.stop_at_step, preemption, an exception) stops its thread: at the loader's next iter(),
at close(), or when it is garbage; the thread is a daemon and never holds the iterator that
the loop holds, so it cannot keep the process alive or the iterator in memory."""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine import recipe as contract
from engine.data.stages import STAGES

POLL_S = 0.1  # how often a waiting thread looks whether it was stopped
DEFAULT_DEPTH = 1  # as torchvision's and DALI's prefetchers: a second thread competes for the GIL


@dataclass(frozen=True)
class Finished:
    """A batch's x already finished on the device: Run.to_device takes it as it is."""

    tensor: torch.Tensor

    def __len__(self) -> int:
        return len(self.tensor)


def finish_ahead(
    loader,
    dataset,
    device: torch.device,
    depth: int = DEFAULT_DEPTH,
    memory_format: torch.memory_format | None = None,
):
    """`loader` itself, or a FinishAhead around it where finishing ahead applies: the dataset
    asks for it (`finishes_ahead`, e.g. decode=gpu's DeviceDecodedFiles), the device is CUDA,
    depth > 0 and the loader has worker processes (see the module's docstring)."""
    finish = contract.device_finisher(dataset)
    wanted = finish is not None and contract.finishes_ahead(dataset)
    workers = getattr(loader, "num_workers", 0) > 0
    if not (wanted and workers and depth > 0 and torch.device(device).type == "cuda"):
        return loader
    return FinishAhead(loader, finish, device, depth, memory_format)


class FinishAhead:
    """An iterable of the loader's Samples with x finished on the device by `finish(x,
    device)`, `depth` batches ahead of the one the loop holds. streams=False (the CPU, tests):
    the same thread and order, without CUDA streams and events. len() and other attributes
    are the loader's."""

    def __init__(
        self,
        loader,
        finish: Callable,
        device: torch.device,
        depth: int = DEFAULT_DEPTH,
        memory_format: torch.memory_format | None = None,
        streams: bool | None = None,
    ):
        if depth < 1:
            raise ValueError(f"FinishAhead needs a depth >= 1, not {depth}")
        device = torch.device(device)
        streams = device.type == "cuda" if streams is None else streams
        if streams and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.loader, self.finish, self.device = loader, finish, device
        self.depth, self.memory_format, self.streams = depth, memory_format, streams
        self._stream = _finishing_stream(device) if streams else None
        self._last: _Handle | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name in ("loader", "_last"):  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> AheadIterator:
        # The loader's iterator may be the same object again (persistent workers): the last
        # pass's thread must be stopped before iter() resets it, or it could take its batches.
        self.close()
        batches = AheadIterator(iter(self.loader), self)
        self._last = batches.handle
        return batches

    def close(self) -> None:
        """Stops the thread of the last pass and waits for it (it ends after the batch it may
        be taking from the loader); what it finished is dropped."""
        if self._last is not None:
            self._last.stop()
        self._last = None


@dataclass
class _Handle:
    """A pass's thread, its stop flag and its finished batches: what the iterator and its
    FinishAhead share (the FinishAhead never holds the iterator, so an abandoned iterator is
    garbage at once and stops its thread)."""

    thread: threading.Thread
    stop_flag: threading.Event
    ready: queue.SimpleQueue

    def stop(self, wait: bool = True) -> None:
        self.stop_flag.set()
        if wait and self.thread is not threading.current_thread():
            self.thread.join()
            while not self.ready.empty():
                self.ready.get_nowait()


class AheadIterator(Iterator):
    """One pass over the loader; the thread finishing its batches is started at creation."""

    def __init__(self, source: Iterator, owner: FinishAhead):
        self._device = owner.device
        self._slots = threading.Semaphore(owner.depth)
        self._done = False
        work = _Work(source, owner.finish, owner.device, owner._stream, owner.memory_format)
        ready, stop = queue.SimpleQueue(), threading.Event()
        thread = threading.Thread(
            target=work.run, args=(ready, self._slots, stop), name="finish-ahead", daemon=True
        )
        self.handle = _Handle(thread, stop, ready)
        thread.start()

    def __next__(self):
        if self._done:
            raise StopIteration
        kind, value, event = self._take()
        if kind == "end":
            self.close()
            raise StopIteration
        if kind == "error":
            raise value
        if event is not None:
            stream = torch.cuda.current_stream(self._device)
            STAGES.stream_wait(stream, event)
            value.x.tensor.record_stream(stream)
        return value

    def _take(self) -> tuple:
        handle = self.handle
        while True:
            try:
                item = handle.ready.get(timeout=POLL_S * 10)
            except queue.Empty:
                if not handle.thread.is_alive() and handle.ready.empty():
                    self._done = True
                    raise RuntimeError("the thread finishing batches ended unannounced") from None
                continue
            self._slots.release()  # the thread may start on the next batch
            return item

    def close(self) -> None:
        """Stop the thread and wait for it; further next() calls end the pass."""
        self._done = True
        self.handle.stop()

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None:  # never waits here: the thread ends on its own within POLL_S
            handle.stop(wait=False)


class _Work:
    """The thread's side: it holds the loader's iterator, never the AheadIterator."""

    def __init__(self, source, finish, device, stream, memory_format):
        self.source, self.finish, self.device = source, finish, device
        self.stream, self.memory_format = stream, memory_format

    def run(self, ready: queue.SimpleQueue, slots: threading.Semaphore, stop: threading.Event):
        try:
            if self.stream is not None:
                torch.cuda.set_device(self.device)  # the current device is per thread
            while _acquire(slots, stop):
                try:
                    batch = next(self.source)
                except StopIteration:
                    ready.put(("end", None, None))
                    return
                except Exception as err:  # noqa: BLE001 - raised where the loop takes it
                    ready.put(("error", err, None))
                    continue
                if stop.is_set():
                    return
                ready.put(self.finished(batch))
        except BaseException as err:  # noqa: BLE001 - anything else ends the pass, told
            ready.put(("error", err, None))
            ready.put(("end", None, None))
        finally:
            self.source = None  # the loader's iterator goes now, not with the thread object

    def finished(self, batch) -> tuple:
        """("batch", the Sample with x finished, its CUDA event or None), or ("error", ...)."""
        try:
            with torch.no_grad():
                if self.stream is None:
                    return "batch", _with_x(batch, self._finish(batch.x)), None
                with torch.cuda.stream(self.stream):
                    x = self._finish(batch.x)
                    event = torch.cuda.Event()
                    event.record(self.stream)
                return "batch", _with_x(batch, x), event
        except Exception as err:  # noqa: BLE001 - raised where the loop takes this batch
            return "error", err, None

    def _finish(self, x) -> torch.Tensor:
        with STAGES.timing("finish_thread"):
            x = self.finish(x, self.device)
            if self.memory_format is not None and x.ndim == 4:
                x = x.contiguous(memory_format=self.memory_format)
        return x


@functools.cache
def _finishing_stream(device: torch.device) -> torch.cuda.Stream:
    """One per device for every pass: the caching allocator keeps freed blocks per stream, so
    a new stream per pass (or per evaluation) would keep more memory cached."""
    return torch.cuda.Stream(device)


def _with_x(batch, x: torch.Tensor):
    """The Sample (a NamedTuple, or a dataclass) with its x finished."""
    if hasattr(batch, "_replace"):
        return batch._replace(x=Finished(x))
    return dataclasses.replace(batch, x=Finished(x))


def _acquire(slots: threading.Semaphore, stop: threading.Event) -> bool:
    """A slot for one more batch ahead; False once stopped."""
    while not stop.is_set():
        if slots.acquire(timeout=POLL_S):
            return not stop.is_set()
    return False
