"""What the Ray pool raises when its workers, its drafter trainer or the Ray cluster itself fail.

RolloutWorkerError: the pool could not finish a call (a task failed on too many workers, results of
the wrong policy version, ...). RolloutBackendLost: the pool itself is gone (no worker left, the
drafter trainer actor died, the Ray cluster's head is unreachable): nothing in this process can
bring it back, so the trainer should save what it holds and the run resume from its checkpoint.
Both are RuntimeErrors; a trainer that checkpoints on error catches RolloutBackendLost.
"""
from __future__ import annotations

RESUME_HINT = ("the run's last checkpoint can be resumed with resume=auto once the cluster is back "
               "(docs/distributed.md#ray-faults)")


class RolloutWorkerError(RuntimeError):
    """A rollout could not be completed by the pool's workers."""


class RolloutBackendLost(RolloutWorkerError):
    """The Ray pool cannot go on: every worker, the drafter trainer or the Ray cluster is gone."""

    def __init__(self, what: str):
        super().__init__(f"{what}\nThe rollout backend is lost; {RESUME_HINT}.")
