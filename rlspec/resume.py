"""Where a run starts, decided before any heavy work: resume, start over, or refuse (docs/resume.md).

`python -m rlspec.train ... resume=auto` continues from the newest complete checkpoint in output_dir
(or starts at step 0 when there is none, so one command both starts and restarts a preemptible job);
`resume=<checkpoint dir>` continues from that one. Without resume, an output_dir that already holds a
run is refused unless `overwrite_output_dir=true`, with a message that names both options. All of it
reads directory listings and small JSON files only: no torch, no model fetch.

The W&B run continues too: a checkpoint's completion marker names the run it logged to, and the
resumed process sets WANDB_RUN_ID and WANDB_RESUME=allow so W&B appends to that run.
"""
from __future__ import annotations

import os
import secrets
import shutil
import sys
from pathlib import Path

from rlspec.config import Config, ConfigError
from trainers import checkpoint_dirs as dirs

# what a run writes in output_dir besides its checkpoints (W&B's own directory aside: it keeps runs by id);
# README.md is TRL's model card
RUN_OUTPUTS = ("final", "crash", "drafter", "summary.json", "README.md")
_RUN_ID_WE_SET = "_RLSPEC_WANDB_RUN_ID"  # to tell our WANDB_RUN_ID of an earlier run() from a user's


def prepare_output_dir(cfg: Config, out: Path, main_process: bool = True) -> str | None:
    """The checkpoint to resume from (None: start at step 0). Raises ConfigError when output_dir holds a run
    and neither resume nor overwrite_output_dir says what to do with it. main_process: whether this process
    may delete (overwrite_output_dir); with several processes only rank 0 does."""
    if cfg.resume == "auto":
        path, skipped = dirs.find_resumable_checkpoint(out)
        for s in skipped:
            print(f"rlspec.train: resume=auto skips the half-written {s}", file=sys.stderr, flush=True)
        if path is None:
            print(f"rlspec.train: resume=auto: no complete checkpoint in {out}; starting at step 0", flush=True)
            return None
        print(f"rlspec.train: resuming from {path}", flush=True)
        return str(path)
    if cfg.resume != "none":
        return str(_explicit_checkpoint(cfg.resume))
    used = previous_run_entries(out)
    if used and not cfg.overwrite_output_dir:
        shown = ", ".join(p.name for p in used[:6]) + (", ..." if len(used) > 6 else "")
        raise ConfigError(f"output_dir {out} already holds a run ({shown}). Pass resume=auto to continue it from its "
                          "newest complete checkpoint, or overwrite_output_dir=true to delete it and start at step 0 "
                          "(or choose another output_dir)")
    doomed = [p for p in used if _is_run_output(p)]
    if doomed and main_process:
        for p in doomed:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        print(f"rlspec.train: overwrite_output_dir: deleted the previous run's {', '.join(p.name for p in doomed)} "
              f"in {out}", flush=True)
    return None


def _is_run_output(path: Path) -> bool:
    """What a run writes (deleted by overwrite_output_dir); anything else in output_dir is left alone."""
    name = path.name
    return name in RUN_OUTPUTS or name.startswith((f"{dirs.PREFIX}-", dirs.TMP_PREFIX, "tmp-old-"))


def previous_run_entries(out: Path) -> list[Path]:
    """Everything in output_dir except W&B's directory (runs there are kept apart by their ids)."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.name != "wandb")


def _explicit_checkpoint(given: str) -> Path:
    path = Path(given).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"resume={given}: no such checkpoint directory; use resume=auto or a checkpoint-N "
                          "directory of a previous run")
    if not dirs.is_complete(path):
        newest, _ = dirs.find_resumable_checkpoint(path.parent)
        hint = f"resume={newest}" if newest else "resume=auto"
        raise ConfigError(f"resume={given}: not a complete checkpoint (no {dirs.MARKER}: it was being written when "
                          f"its run stopped, or it is not a checkpoint directory); try {hint}")
    return path


def set_wandb_run_id(resume_from: str | None) -> str:
    """Point W&B at the resumed run (the id in the checkpoint's marker, WANDB_RESUME=allow) or at a new id.
    A WANDB_RUN_ID the user exported wins."""
    ours = os.environ.get(_RUN_ID_WE_SET)
    user_id = os.environ.get("WANDB_RUN_ID")
    if user_id and user_id != ours:
        return user_id
    saved = (dirs.read_marker(resume_from) or {}).get("wandb_run_id") if resume_from else None
    run_id = saved or secrets.token_hex(4)
    os.environ["WANDB_RUN_ID"] = os.environ[_RUN_ID_WE_SET] = run_id
    if saved:
        os.environ["WANDB_RESUME"] = "allow"
    else:
        os.environ.pop("WANDB_RESUME", None)
    return run_id
