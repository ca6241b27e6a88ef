"""Timings that feed decisions wait for the device: a step that returns when its work is queued (a CUDA replay)
must not be timed at its launch, nor charged with the previous shape's work (runtime/device.py)."""
import queue
import threading
import time

import torch

from rlspec.rollout.runtime.device import DeviceTimer, synchronize
from rlspec.rollout.speculation.cost_model import CostModel

SECONDS_PER_TOKEN = 0.02


class QueuedRunner:
    """A device stand-in: `step` queues T x SECONDS_PER_TOKEN of work on a worker thread and returns at once,
    as a CUDA graph replay returns once it is queued; `synchronize` waits for the queue, as the device does."""

    def __init__(self):
        self.work: queue.Queue = queue.Queue()
        self.syncs = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            seconds = self.work.get()
            time.sleep(seconds)
            self.work.task_done()

    def step(self, tokens, start, *args):
        self.work.put(tokens.shape[1] * SECONDS_PER_TOKEN)

    def synchronize(self):
        self.syncs += 1
        self.work.join()


def test_calibration_times_each_anchor_by_its_own_device_work():
    runner = QueuedRunner()
    timed = CostModel().calibrate(runner, max_batch=1, Ts=[1, 2, 4])
    # unsynchronised, every anchor measured its launch (~0 s) while the warm-ups' 0.14 s ran behind it
    for (b, T), seconds in timed.items():
        assert 0.8 * T * SECONDS_PER_TOKEN <= seconds <= T * SECONDS_PER_TOKEN + 0.05, (T, seconds)
    assert timed[(1, 4)] > timed[(1, 2)] > timed[(1, 1)]
    assert runner.syncs == 2 * len(timed)  # before and after each anchor


def test_device_timer_excludes_earlier_work_and_includes_its_own():
    runner = QueuedRunner()
    runner.step(torch.zeros(1, 5), None)  # 0.1 s queued before the timer
    with DeviceTimer(sync=runner.synchronize) as clock:
        runner.step(torch.zeros(1, 1), None)
    assert 0.8 * SECONDS_PER_TOKEN <= clock.seconds <= SECONDS_PER_TOKEN + 0.05


def test_synchronize_off_cuda_is_a_no_op():
    synchronize("cpu")
    synchronize(None)
    with DeviceTimer("cpu") as clock:
        pass
    assert clock.seconds >= 0.0
