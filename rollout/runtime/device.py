"""The device's clock and ordering: every CUDA-only call that timings and cross-stream buffers need, with a
CPU fallback of the same API (nothing to wait for where work runs as it is issued).

Why: a CUDA call returns when its work is queued, not done. A timer read right after `runner.step` measures
the launch, and the next timer then pays for this step's kernels: each shape of a calibration was timed
with the previous shape's work. `DeviceTimer` synchronises before it starts (work queued earlier is not
counted) and before it stops (work queued inside is); every timing that feeds a decision goes through it
(the cost model's calibration, the weight sync's seconds). `StreamFence` orders a buffer written on one
stream and read on another (the drafter's feature ring: engine writes, trainer reads) with events. `Span` times
device work the host does not wait for.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


def synchronize(device) -> None:
    """Wait until every kernel queued on `device` has run (CUDA, MPS); nothing elsewhere."""
    device = torch.device(device) if device is not None else None
    if device is None:
        return
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class DeviceTimer:
    """`with DeviceTimer(device) as t: ...` then `t.seconds`: wall seconds of the device work issued inside.

    sync: how to wait for the device (default `synchronize(device)`); an object that runs work
    asynchronously (a ModelRunner, a test's stand-in device) passes its own `synchronize`."""

    def __init__(self, device=None, sync: Callable[[], None] | None = None):
        self.sync = sync if sync is not None else (lambda: synchronize(device))
        self.seconds = 0.0

    def __enter__(self) -> "DeviceTimer":
        self.sync()  # work queued before the block is no part of it
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.sync()  # work queued inside the block is
        self.seconds = time.perf_counter() - self.t0


class Span:
    """The device's seconds over a stretch of the host's program (`start` ... `stop`, then `seconds()` once the work
    is done, e.g. after the step's transfer was read: no wait): timing events around it on a CUDA device, the host's
    clock where work runs as issued. Why: a drafter that leaves its drafts on the device returns before they are
    drawn, and by the host's clock a GPU's drafting would count as the verify after it."""

    def __init__(self, device):
        cuda = torch.device(device).type == "cuda"
        self.events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) if cuda else None
        self.t0 = self.t1 = 0.0

    def start(self) -> "Span":
        self.t0 = time.perf_counter()
        if self.events is not None:
            self.events[0].record()
        return self

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.t1 = time.perf_counter()

    def done(self) -> bool:
        """Whether the device ran the span's work, so that `seconds()` reads without waiting (a CUDA event's
        elapsed time raises before then)."""
        return self.events is None or self.events[1].query()

    def seconds(self) -> float:
        if self.events is not None:
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.t1 - self.t0


class _NoEvent:
    """A CUDA event's API where work runs as issued (CPU): nothing to record or wait for."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


def new_event(device):
    """A CUDA event on a CUDA device, else an event whose record and wait do nothing."""
    return torch.cuda.Event() if torch.device(device).type == "cuda" else _NoEvent()


class StreamFence:
    """Orders one buffer across streams. Writers call `before_write` / `after_write` around their writes,
    readers `before_read` / `after_read` around their reads, all under the buffer's lock:
      * a read waits for the last write's event (the data it reads is in place);
      * a write waits for the events of the reads issued before it (a ring that wraps must not overwrite
        rows a queued read has not copied yet).
    Each call acts on the calling thread's current stream. `event` makes events (tests pass a stand-in
    that logs the order of record and wait)."""

    def __init__(self, device, event: Callable[[], object] | None = None):
        self._event = event or (lambda: new_event(device))
        cuda = torch.device(device).type == "cuda"
        # reads on one stream run in order: its last read's event covers the earlier ones
        self._stream = (lambda: torch.cuda.current_stream(device).cuda_stream) if cuda else (lambda: None)
        self._written = None  # the last write's event
        self._reads: dict = {}  # stream -> the event of its last read since the last write

    def before_write(self) -> None:
        for ev in self._reads.values():
            ev.wait()
        self._reads = {}

    def after_write(self) -> None:
        self._written = self._event()
        self._written.record()

    def before_read(self) -> None:
        if self._written is not None:
            self._written.wait()

    def after_read(self) -> None:
        ev = self._event()
        ev.record()
        self._reads[self._stream()] = ev
