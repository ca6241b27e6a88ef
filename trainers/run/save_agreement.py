"""Every rank learns at once when any rank's part of a checkpoint save failed (a full disk, a quota, EIO).

A checkpoint is written by every process (rank 0 the model, optimizer and marker; each rank its RNG and
rlspec state) between barriers. A rank whose write raises used to leave that barrier unreached: the others
waited there for the collective timeout (30 minutes by default) before failing with a timeout that does not
say why. Here each rank enters the same collective with its own outcome instead of a bare barrier, so a
failure on any rank becomes `CheckpointSaveFailed` on every rank, naming the rank and its error, as soon as
the others get there.

The collective takes the place of the barrier, so it costs nothing extra. What it cannot reach: a failure
inside a save that is itself a collective (DeepSpeed ZeRO's and FSDP's sharded saves), where the others
wait in that collective; torchrun then ends them when the failed rank exits.
"""
from __future__ import annotations

import errno


class CheckpointSaveFailed(RuntimeError):
    """A rank could not write its part of a checkpoint; nothing of it was published. Raised on every rank.
    exit_code: the CLI's (no crash copy is written: the disk that refused the checkpoint would refuse it)."""

    exit_code = 1

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures  # rank -> "ErrorType: message"


def describe(exc: BaseException) -> str:
    name = errno.errorcode.get(getattr(exc, "errno", None) or -1)
    return f"{type(exc).__name__}{f' ({name})' if name else ''}: {exc}"


def agree(error: BaseException | None, world_size: int, what: str, newest=lambda: None) -> None:
    """Enter once on every rank with this rank's outcome (None: fine); raise CheckpointSaveFailed on every rank
    when any failed. With one process the error itself is wrapped and raised.

    what: the checkpoint (for the message); newest(): the newest complete checkpoint the run can continue from
    (asked only on a failure)."""
    mine = None if error is None else describe(error)
    if world_size > 1:
        import torch.distributed as dist

        outcomes: list[str | None] = [None] * world_size
        dist.all_gather_object(outcomes, mine)
    else:
        outcomes = [mine]
    failures = {rank: m for rank, m in enumerate(outcomes) if m is not None}
    if not failures:
        return
    who = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items())) if world_size > 1 else failures[0]
    full = any("ENOSPC" in m or "EDQUOT" in m for m in failures.values())
    fix = "free space on the output_dir's disk (or lower grpo.save_total_limit)" if full else "fix the cause"
    exc = CheckpointSaveFailed(f"{what} could not be written ({who}); nothing of it was published, so no "
                               f"checkpoint is rotated out. The newest complete checkpoint is {newest() or 'none'}: "
                               f"{fix}, then continue with resume=auto.", failures)
    raise exc from error


def run_part(fn, *args) -> BaseException | None:
    """fn(*args); the exception it raised (any: a rank must reach the agreement whatever went wrong), or None.
    A KeyboardInterrupt (a second signal: abort now) is not caught."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
        return exc
    return None

