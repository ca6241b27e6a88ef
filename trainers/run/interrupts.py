"""What stops a run before its last step, and how it stops cleanly: signals and non-finite logits.

SIGTERM (spot preemption, `kill`) and SIGINT (Ctrl-C) during `train()` do not kill the process: the
handler only raises a flag, and at the end of the step under way `StopOnSignal` asks the Trainer to
save a checkpoint and stop. `train()` then raises `TrainingInterrupted` (exit code 128 + signal:
143 for SIGTERM, 130 for SIGINT) once the checkpoint is complete. A second signal aborts at once.

Non-finite logits (`rlspec.rollout.errors.NonFiniteLogitsError`, raised by the engine's generate) follow the
trainer's `on_nonfinite` policy: "stop" (default) or "skip_batch" (ON_NONFINITE below; the stop path's
checkpoint is written by trainers/run/checkpoint.py).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

from transformers import TrainerCallback

from rlspec.rollout.errors import NonFiniteLogitsError

ON_NONFINITE = ("stop", "skip_batch")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(Exception):
    """Training stopped on a signal after writing a complete checkpoint.

    signum: the signal; step: the last finished step; checkpoint: its checkpoint directory (None if the
    save failed); exit_code: 128 + signum, what a shell reports for a process ended by that signal."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (see the errors above)"
        super().__init__(f"{name} received: stopped after step {step}, {where}; continue with resume=auto")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum


class StopOnSignal(TrainerCallback):
    """Set `signum` (the signal handler does) and the Trainer saves a checkpoint and stops at the end of
    the current step: a full, consistent checkpoint rather than one of a half-done step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.aborted = False  # a second signal came: abort now, never save

    def on_step_end(self, args, state, control, **kwargs):
        if self.aborted:
            # the handler re-delivered the signal to the previous disposition, which may not end anything (SIGINT
            # is ignored in a process a non-interactive shell started in the background), or its KeyboardInterrupt
            # may land in code that swallows it: never let the step end in a checkpoint after an abort
            raise KeyboardInterrupt("second signal: aborted without a checkpoint")
        if self.signum is not None:
            control.should_save = True
            control.should_training_stop = True


@contextlib.contextmanager
def stop_on_signals(callback: StopOnSignal):
    """While the block runs, SIGTERM/SIGINT set callback.signum instead of ending the process; a second
    signal restores the previous handler and re-delivers itself (abort now). A no-op off the main thread,
    where Python cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}

    def handler(signum, frame):
        if callback.signum is not None:
            print(f"rlspec: second {signal.Signals(signum).name}: aborting without a checkpoint", file=sys.stderr,
                  flush=True)
            callback.aborted = True
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
            return
        callback.signum = signum
        print(f"rlspec: {signal.Signals(signum).name} received: finishing the current step, then writing a "
              "checkpoint (send it again to abort at once)", file=sys.stderr, flush=True)

    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def check_on_nonfinite(value: str) -> str:
    if value not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {list(ON_NONFINITE)}, got {value!r}")
    return value


class NonFiniteWeightsError(NonFiniteLogitsError):
    """The policy's weights were NaN/inf when the final model was due: it was not written (a checkpoint due at
    such a step is skipped with a line instead: a checkpoint of them would only push good ones out of the
    rotation). checkpoint: the newest complete one."""

    exit_code = 1

    def __init__(self, message: str, param: str | None, checkpoint: str | None):
        super().__init__(message, first_bad=param)
        self.param, self.checkpoint = param, checkpoint


def weights_finite(model) -> bool:
    """Whether every parameter is finite: one isfinite-all per tensor on its own device, stacked, and a single
    host sync (no copy of the weights, no pass per element in Python)."""
    import torch

    flags = [torch.isfinite(p).all() for p in model.parameters() if p.numel()]
    if not flags:
        return True
    device = flags[0].device
    return bool(torch.stack([f.to(device) for f in flags]).all())


def first_nonfinite_parameter(model) -> str | None:
    """The name of the first parameter holding NaN/inf, None when all are finite (one pass, no copy)."""
    import torch

    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            return name
    return None


def nonfinite_message(exc, failing_step: int, outcome: str) -> str:
    """The stop path's message: where it happened, what was kept, how to go on."""
    rows = ", ".join(map(str, exc.rows[:8])) + (" ..." if len(exc.rows) > 8 else "")
    return (f"step {failing_step}: the policy's logits were NaN/inf (rollout decode step {exc.step}, rows [{rows}], "
            f"first non-finite: {exc.first_bad or 'not located'}). on_nonfinite=stop: {outcome} Fix the cause "
            "(a lower learning rate, max_grad_norm, dtype=float32), then continue with resume=auto (or "
            "resume=<checkpoint dir>); or set on_nonfinite=skip_batch to skip such batches and go on.")
