"""trainers/run/interrupts.py: a second signal aborts without a checkpoint even when the signal it re-delivers
ends nothing (SIGINT ignored: a process started in the background by a non-interactive shell) or its
KeyboardInterrupt is lost (a finalizer or a library's broad except swallows it)."""
import os
import signal

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from rlspec.trainers.run.interrupts import StopOnSignal, stop_on_signals


def test_a_swallowed_abort_still_stops_before_the_checkpoint(monkeypatch, tmp_path):
    swallowed = []
    signal.signal(signal.SIGINT, lambda s, f: swallowed.append(s))  # the re-delivered signal gets lost here
    try:
        cb = StopOnSignal()
        with stop_on_signals(cb):
            os.kill(os.getpid(), signal.SIGINT)  # first: finish the step, then save
            control = TrainerControl()
            cb.on_step_end(TrainingArguments(output_dir=str(tmp_path)), TrainerState(), control)
            assert control.should_save and control.should_training_stop and not cb.aborted
            os.kill(os.getpid(), signal.SIGINT)  # second: abort; its KeyboardInterrupt never arrives
            assert swallowed == [signal.SIGINT] and cb.aborted
            with pytest.raises(KeyboardInterrupt):
                cb.on_step_end(TrainingArguments(output_dir=str(tmp_path)), TrainerState(), TrainerControl())
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
