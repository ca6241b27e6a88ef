"""What a run does differently when `accelerate launch` starts several training processes.

Every process (rank) trains its share of each batch and has its own colocated rollout engine, as
TRL's vLLM "colocate" mode does; what belongs to the run rather than to a rank is done once
(docs/distributed.md):

- rank 0 alone writes per-run outputs: summary.json and the summary table, the crash model, and the
  learned drafter (the Trainer already writes checkpoints and final/ from rank 0 only);
- work that fills a shared cache runs on rank 0 first, then on the others, which find it filled: the
  embedded model's conversion, and the drafter's warm start (so every rank starts from rank 0's drafter);
- a crash path never enters a collective: a crashed rank cannot count on its peers to join one, and a
  hang would keep torchrun from ending the run. So under ZeRO-3 (where saving needs a gather) no crash
  model is written; the last checkpoint is the run's copy, and every checkpoint carries the drafter
  as of that step (DrafterCheckpointCallback), so a crash loses neither.

With one process every function here does what the single-process run always did.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from transformers import TrainerCallback


def is_main_process(trainer) -> bool:
    """Whether this process writes the run's own outputs (rank 0, or the only process)."""
    return trainer.is_world_process_zero()


def zero_stage(trainer) -> int | None:
    """The DeepSpeed ZeRO stage the trainer runs under, None without DeepSpeed."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    return trainer.accelerator.state.deepspeed_plugin.zero_stage


def main_process_first(args, what: str):
    """Run the block on each machine's first process first, then on its other processes (a no-op with one
    process): the caches it fills ($RLSPEC_CACHE) are per machine.

    args: the trainer's TrainingArguments (its distributed state exists once they are built)."""
    if args.world_size <= 1:
        return contextlib.nullcontext()
    return args.main_process_first(local=True, desc=what)


def save_crash_model(trainer, path: Path) -> None:
    """Best-effort save of the current policy on the crash path; never raises, never waits on other ranks.

    One process: the Trainer's save_model. Several: rank 0 writes its own copy, which DDP and ZeRO-2 keep
    whole on every rank; under ZeRO-3 the copy is sharded and gathering it is a collective the crashed
    ranks may never join, so nothing is written and the last checkpoint stands in for it.
    """
    try:
        if trainer.args.world_size <= 1:
            trainer.save_model(str(path))
        elif zero_stage(trainer) == 3:
            if is_main_process(trainer):
                print(f"rlspec.train: no crash model under ZeRO-3 (saving would gather shards from ranks that may "
                      f"have died); the last checkpoint-N in {path.parent} is the run's latest saved policy",
                      file=sys.stderr)
        elif is_main_process(trainer):
            trainer._save(str(path))  # the Trainer's own writer (PPO overrides it), without save_model's gather
    except Exception as exc:  # noqa: BLE001
        print(f"rlspec.train: could not save the crash model to {path}: {type(exc).__name__}: {exc}", file=sys.stderr)


class DrafterCheckpointCallback(TrainerCallback):
    """Exports the learned drafter into every checkpoint (checkpoint-N/drafter) from rank 0, so a crash
    (even one that kills rank 0 before the end-of-run export) loses no drafter the last checkpoint had.

    Set `engine` (the trainer's rollout backend) once the trainer exists; without a learned drafter, or
    with drafter.export off, it does nothing. The trainer calls `write_checkpoint` while the checkpoint is
    still under its temporary name (trainers/run/checkpoint.py), so the export is part of the atomic checkpoint.
    """

    def __init__(self, export: bool):
        self.export = export
        self.engine = None
        self.exported: list[str] = []

    def write_checkpoint(self, checkpoint_dir: str, trainer) -> None:
        engine, step = self.engine, trainer.state.global_step
        if not (self.export and trainer.is_world_process_zero() and engine is not None and engine.has_learned_drafter):
            return
        path = Path(checkpoint_dir) / "drafter"
        try:
            self.exported.append(engine.export_drafter(str(path), metadata={"step": step}))
        except Exception as exc:  # noqa: BLE001 - a drafter export must never stop training
            print(f"rlspec.train: could not export the drafter to {path}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
