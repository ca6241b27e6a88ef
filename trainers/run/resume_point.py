"""Which checkpoint a run resumes from, and what an explicit resume does to the checkpoints after it.

Shared by the CLI (rlspec/resume.py, before any heavy import) and CheckpointMixin.train (the Python API):

- `explicit_checkpoint(path)`: a checkpoint named by the operator (`resume=<dir>`,
  `train(resume_from_checkpoint=<dir>)`) is taken when it holds rlspec's completion marker, or, without
  one (an older rlspec, a plain HF/TRL checkpoint), when its files verify (trainers/run/checkpoint_verify.py);
  otherwise a ValueError says what is missing and which checkpoint would do.
- `roll_back(output_dir, checkpoint)`: resuming from a checkpoint older than the newest one in output_dir is a
  rollback; the newer checkpoints are another branch. They are moved into abandoned-<date>-from-<step>/
  (trainers/run/checkpoint_dirs.py), which resume=auto and rotation never look into, so a later resume=auto
  (after a preemption) continues the rolled-back branch and rotation cannot delete its starting point.
Plain files, no torch.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from rlspec.trainers.run import checkpoint_dirs as dirs
from rlspec.trainers.run.checkpoint_verify import checkpoint_problems


def explicit_checkpoint(given: str | os.PathLike) -> Path:
    """The checkpoint directory to resume from, checked; ValueError (saying why and what to do) otherwise."""
    path = Path(given).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"resume={given}: no such checkpoint directory; use resume=auto or a checkpoint-N "
                         "directory of a previous run")
    if dirs.is_complete(path):
        return path
    problems = checkpoint_problems(path)
    if problems:
        newest, _ = dirs.find_resumable_checkpoint(path.parent)
        hint = f"resume={newest}" if newest else "resume=auto (which starts at step 0 when there is no checkpoint)"
        raise ValueError(f"resume={given}: not a complete checkpoint: it has no {dirs.MARKER} (rlspec writes it "
                         f"last) and its files do not verify: {'; '.join(problems)}. It was being written when its "
                         f"run stopped, or it is not a checkpoint directory; try {hint}")
    print(f"rlspec: {path} has no {dirs.MARKER} (an older rlspec or a plain HF/TRL checkpoint); its files verify, "
          "resuming from it", file=sys.stderr, flush=True)
    return path


def roll_back(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> Path | None:
    """Set aside output_dir's checkpoints newer than `checkpoint` (see the module docstring) and say where;
    returns the folder they went to (None when there was nothing newer)."""
    step = dirs.checkpoint_step(checkpoint)
    if step is None:
        return None
    folder, moved = dirs.set_aside_newer(output_dir, step)
    if folder is not None:
        names = ", ".join(p.name for p in moved)
        print(f"rlspec: resuming from step {step}, older than the newest checkpoint: moved the newer {names} aside "
              f"to {folder} (resume=auto and rotation ignore it; delete it once you no longer need that branch)",
              file=sys.stderr, flush=True)
    return folder
