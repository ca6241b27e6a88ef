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


def test_a_step_charges_the_drafting_its_span_and_the_verify_the_rest(monkeypatch):
    """The selector gets the drafting's seconds as its Span measured them (on a GPU the device's, read after the
    step's transfer: a learned drafter returns before its drafts are drawn) and the verify the rest of the step's wall
    time from the span's start, so the two add up to the step whatever the host's clock said of the drafting."""
    from rlspec.bench.host import tiny_model
    from rlspec.rollout import decode
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.device import Span
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.types import SamplingParams, SpecConfig
    from tests.conftest import random_prompts

    spans = []

    class Charged(Span):  # the drafting said to take 50 ms, more than the host's clock gives any step
        def start(self):
            spans.append(self)
            return super().start()

        def seconds(self) -> float:
            return 0.05

    monkeypatch.setattr(decode, "Span", Charged)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=2, online_training=False)
    eng = RolloutEngine(tiny_model(3), None, spec=spec, eos_token_ids=[2])
    eng.speculation.force(Arm("eagle3", 2, 1))
    seen, real = [], eng.speculation.observe_step

    def observed(arm, batch, seconds, draft_seconds, drafted, accepted):
        seen.append((seconds, draft_seconds, time.perf_counter() - spans[-1].t0))
        return real(arm, batch, seconds, draft_seconds, drafted, accepted)

    monkeypatch.setattr(eng.speculation, "observe_step", observed)
    eng.generate(random_prompts(2, 4, 8, seed=1, vocab=64), SamplingParams(temperature=0, max_new_tokens=12))
    assert len(seen) >= 5 and all(d == 0.05 for _, d, _ in seen)
    # the wall clock read here, after the engine's: later by the host's time in between (a loaded machine's
    # milliseconds), far below the 50 ms the drafting would add were it charged the host's clock instead of its span
    assert all(-2e-4 < wall - (s + d) < 5e-3 for s, d, wall in seen), seen
