"""Where a run starts, decided before any heavy work: resume, start over, or refuse (docs/resume.md).

`python -m rlspec.train ... resume=auto` continues from the newest complete checkpoint in output_dir
(or starts at step 0 when there is none, so one command both starts and restarts a preemptible job);
`resume=<checkpoint dir>` continues from that one (an older one than the newest is a rollback: the newer
checkpoints are set aside, trainers/run/resume_point.py). Without resume, an output_dir that already holds
anything is refused unless `overwrite_output_dir=true`, which deletes only what rlspec wrote there (its
manifest, trainers/run/run_files.py). output_dir itself must be a directory of the run's own: empty, `/`, the
home directory and the current directory's parents are refused. One process per output_dir
(trainers/run/run_lock.py). All of it reads directory listings and small JSON files only: no torch, no model
fetch.

The W&B run continues too: a checkpoint's completion marker names the run it logged to, and the
resumed process sets WANDB_RUN_ID and WANDB_RESUME=allow so W&B appends to that run.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import sys
from pathlib import Path

from rlspec.config import Config, ConfigError
from rlspec.trainers.run import checkpoint_dirs as dirs
from rlspec.trainers.run import run_files, run_lock
from rlspec.trainers.run.resume_point import explicit_checkpoint, roll_back

# what a run writes in output_dir besides checkpoints and final/: each is recorded in the manifest just before
# the run writes it (run_files.claim), and one of the user's already there is left alone, never claimed (W&B's
# own directory aside: it keeps runs by id and is never deleted)
RUN_OUTPUTS = ("crash", "drafter", "summary.json")
# names a run writes into, mixing its files with what is there: an entry so named that rlspec did not write
_RUN_NAMES = re.compile(rf"^(final|tmp-final|{dirs.PREFIX}-\d+|{dirs.TMP_PREFIX}\d+|"
                        rf"{dirs.OLD_PREFIX}.*|{dirs.ABANDONED_PREFIX}.*)$")
_RUN_ID_WE_SET = "_RLSPEC_WANDB_RUN_ID"  # to tell our WANDB_RUN_ID of an earlier run() from a user's


def resolve_output_dir(value: str | None) -> Path:
    """output_dir as an absolute path; refused (ConfigError) when it is not a directory of the run's own:
    empty (the current directory by accident), `/`, the home directory, or a parent of the current
    directory, where checkpoints would mix with other files and overwrite_output_dir would act on them."""
    fix = "set output_dir to a directory of the run's own, e.g. output_dir=outputs/run"
    if value is None or not str(value).strip():
        raise ConfigError(f"output_dir is empty, which would mean the current directory; {fix}")
    out = Path(str(value)).expanduser().resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if out == Path(out.anchor):
        raise ConfigError(f"output_dir={value} is the filesystem root; {fix}")
    if out == home:
        raise ConfigError(f"output_dir={value} is the home directory; {fix}")
    if out in cwd.parents:
        raise ConfigError(f"output_dir={value} is a parent of the current directory ({cwd}); {fix}")
    return out


def output_dir_lock(out: Path, main_process: bool = True):
    """Hold output_dir's lock for the run (rank 0 alone: the other ranks are the same run)."""
    return run_lock.hold(out) if main_process else contextlib.nullcontext()


def prepare_output_dir(cfg: Config, out: Path, main_process: bool = True) -> str | None:
    """The checkpoint to resume from (None: start at step 0). Raises ConfigError when output_dir holds a run
    and neither resume nor overwrite_output_dir says what to do with it. main_process: whether this process
    may change output_dir (overwrite, a rollback's set-aside, the manifest); with several processes only rank 0
    does."""
    links = [out / n for n in run_files.BOOKKEEPING if (out / n).is_symlink()]
    if links:
        raise ConfigError(f"{_shown(links)} in output_dir {out} is a symlink: rlspec never writes through one there "
                          "(it would write wherever the link points); remove it")
    resume_from = _resume_point(cfg, out, main_process)
    if resume_from is None and cfg.resume == "none":
        _start_over(cfg, out, main_process)
    return resume_from


def _resume_point(cfg: Config, out: Path, main_process: bool) -> str | None:
    if cfg.resume == "auto":
        path, skipped = dirs.find_resumable_checkpoint(out)
        for s in skipped:
            print(f"rlspec.train: resume=auto skips the {s.kind} {s}", file=sys.stderr, flush=True)
        if path is None:
            print(f"rlspec.train: resume=auto: no complete checkpoint in {out}; starting at step 0", flush=True)
            return None
        print(f"rlspec.train: resuming from {path}", flush=True)
        return str(path)
    if cfg.resume == "none":
        return None
    try:
        path = explicit_checkpoint(cfg.resume)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if main_process:  # before the model loads: a run stopped meanwhile still resumes this branch with resume=auto
        roll_back(out, path)
    return str(path)


def _start_over(cfg: Config, out: Path, main_process: bool) -> None:
    """resume=none: output_dir must be empty, or overwrite_output_dir deletes what rlspec wrote there."""
    used = previous_run_entries(out)
    ours = set(run_files.recorded(out))
    if used and not cfg.overwrite_output_dir:
        what = "already holds a run" if any(p.name in ours for p in used) else "is not empty"
        raise ConfigError(f"output_dir {out} {what} ({_shown(used)}). Pass resume=auto to continue a run from its "
                          "newest complete checkpoint, or overwrite_output_dir=true to delete what rlspec wrote there "
                          "and start at step 0 (other files are kept), or choose another output_dir")
    foreign = [p for p in used if p.name not in ours and _RUN_NAMES.match(p.name)]
    if foreign:
        raise ConfigError(f"overwrite_output_dir=true deletes only what rlspec wrote in {out} (the names in its "
                          f"{run_files.MANIFEST}), but {_shown(foreign)} there carry names a run writes and were not "
                          "written by it (another tool's checkpoints?): this run would overwrite them or mix its "
                          "checkpoints with them. Move them out of output_dir, or choose another output_dir")
    doomed = [p for p in used if p.name in ours]
    if doomed and main_process:
        for p in doomed:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        run_files.forget(out, [p.name for p in doomed])
        print(f"rlspec.train: overwrite_output_dir: deleted the previous run's {_shown(doomed, 12)} in {out}",
              flush=True)


def _shown(paths: list[Path], n: int = 6) -> str:
    return ", ".join(p.name for p in paths[:n]) + (", ..." if len(paths) > n else "")


def previous_run_entries(out: Path) -> list[Path]:
    """Everything in output_dir except W&B's directory (runs there are kept apart by their ids) and rlspec's
    manifest and lock."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.name != "wandb" and p.name not in run_files.BOOKKEEPING)


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
