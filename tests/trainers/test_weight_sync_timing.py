"""The weight sync's seconds (rollout/sync_s) include the copies the push queued on the engine's device, not just
their launch (runtime/device.py)."""
import torch

from tests.rollout.speculation.test_cost_timing import QueuedRunner
from rlspec.trainers.weight_sync import sync_weights

COPY_SECONDS = 0.1


class QueuedEngine:
    """An in-process engine stand-in whose load_weights queues its copies on a device stand-in and returns."""

    def __init__(self):
        self.runner = QueuedRunner()
        self.names: list[str] = []

    def load_weights(self, named_tensors):
        self.names = [name for name, _ in named_tensors]
        self.runner.work.put(COPY_SECONDS)


def test_sync_seconds_wait_for_the_queued_copies():
    engine = QueuedEngine()
    seconds, gathers = sync_weights(torch.nn.Linear(4, 4), engine)
    assert engine.names == ["weight", "bias"] and gathers == 0
    assert seconds >= 0.8 * COPY_SECONDS  # unsynchronised: the launch alone, ~0 s
    assert engine.runner.syncs == 2
