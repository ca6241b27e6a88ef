"""The drafter's feature ring is written on the engine's stream and read on the trainer's: each read waits for the
last write's event, each write for the reads queued before it (feature_buffer.py, runtime/device.py). A stand-in
event logs the order of record and wait; the CUDA run is tests/gpu/test_cuda_device_order.py."""
import torch

from rlspec.rollout.runtime.device import StreamFence
from rlspec.rollout.speculation.training.feature_buffer import FeatureBuffer

WIDTH = 6


class LoggedEvent:
    """A CUDA event's record / wait, logged with the event's number into a shared list."""

    def __init__(self, log: list, n: int):
        self.log, self.n = log, n

    def record(self, stream=None):
        self.log.append(("record", self.n))

    def wait(self, stream=None):
        self.log.append(("wait", self.n))


def _buffer(capacity: int):
    log: list = []
    made = []

    def event():
        made.append(LoggedEvent(log, len(made)))
        return made[-1]

    return FeatureBuffer(capacity, WIDTH, torch.float32, "cpu", topk=0, event=event), log


def _sample(buf: FeatureBuffer, n: int, value: float):
    buf.add(torch.full((n, WIDTH), value), list(range(n + 1)), policy_version=0)


def test_a_read_waits_for_the_write_before_it():
    buf, log = _buffer(16)
    _sample(buf, 8, 1.0)
    assert log == [("record", 0)]  # the write's event
    assert buf.sample(2, 4, torch.Generator().manual_seed(0)) is not None
    assert log[1:] == [("wait", 0), ("record", 1)]  # the read waited for it, then recorded its own
    buf.token_mass(16)
    assert log[3:] == [("wait", 0), ("record", 2)]


def test_a_wrapped_write_waits_for_the_read_of_the_rows_it_overwrites():
    buf, log = _buffer(16)
    _sample(buf, 10, 1.0)  # rows 0..9
    got = buf.sample(2, 8, torch.Generator().manual_seed(0))  # queued reads of rows 0..9 (event 1)
    assert log[-1] == ("record", 1)
    _sample(buf, 10, 2.0)  # 10 + 10 > 16: the ring wraps onto rows 0..9
    # before writing, the engine's stream waits for the read's event; only then the write records its own
    assert log[3:] == [("wait", 1), ("record", 2)]
    assert bool((got.feats[got.valid] == 1.0).all())  # the windows read before the wrap hold the old sample
    _sample(buf, 4, 3.0)
    assert log[5:] == [("record", 3)]  # no read since the last write: nothing to wait for


def test_reads_on_one_stream_leave_one_event_to_wait_for():
    log: list = []
    events = iter(range(10))
    fence = StreamFence("cpu", lambda: LoggedEvent(log, next(events)))
    fence.after_write()
    for _ in range(3):
        fence.before_read()
        fence.after_read()
    log.clear()
    fence.before_write()
    assert log == [("wait", 3)]  # the last read (its stream runs the earlier ones first), once
    fence.before_write()
    assert log == [("wait", 3)]


def test_checkpoint_reads_and_restores_are_fenced():
    buf, log = _buffer(16)
    _sample(buf, 8, 1.0)
    st = buf.state_dict()
    assert log[1:] == [("wait", 0), ("record", 1)]
    buf.load_state_dict(st)
    assert log[3:] == [("wait", 1), ("record", 2)]
