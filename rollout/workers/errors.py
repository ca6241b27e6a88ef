"""What the Ray pool raises when its workers, its drafter trainer or the Ray cluster itself fail.

RolloutWorkerError: the pool could not finish a call (a task failed on too many workers, results of
the wrong policy version, ...). RolloutBackendLost: the pool itself is gone (no worker left, the
drafter trainer actor died, the Ray cluster's head is unreachable): nothing in this process can
bring it back, so the trainer saves what it holds and the run resumes from its checkpoint
(trainers/checkpoint.py). Both live in rollout/errors.py, beside the other backend errors, so a trainer
can catch them without importing the pool; they are re-exported here for the pool's modules.
"""
from __future__ import annotations

from rollout.errors import RESUME_HINT, RolloutBackendLost, RolloutWorkerError

__all__ = ["RESUME_HINT", "RolloutBackendLost", "RolloutWorkerError"]
