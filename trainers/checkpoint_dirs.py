"""The checkpoint directories of a run's output_dir: names, completeness, the newest complete one, rotation.

Plain files and names, no torch: the CLI reads these before any heavy import (resume=auto, the refusal
to start into a used output_dir). What a checkpoint holds and how it is written is trainers/checkpoint.py.

    checkpoint-N/               a checkpoint; complete only when it holds rlspec_complete.json
    checkpoint-N/rlspec_complete.json   written last: {"step", "time", "wandb_run_id"}
    tmp-checkpoint-N/           a checkpoint being written (renamed to checkpoint-N when complete)

transformers' get_last_checkpoint and rotation match only `checkpoint-<digits>`, so they never see a
temporary directory; a checkpoint-N without the marker (a checkpoint written by a crashed run of an
older layout, or a copy cut short) is skipped by resume=auto and reported.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "checkpoint"
TMP_PREFIX = "tmp-checkpoint-"
MARKER = "rlspec_complete.json"
STATE_FILE = "rlspec_state.pt"
_CHECKPOINT = re.compile(rf"^{PREFIX}-(\d+)$")
_TMP = re.compile(rf"^{TMP_PREFIX}(\d+)$")


@dataclass
class Skipped:
    """A directory resume=auto passed over, and why."""

    path: Path
    step: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}-{step}"


def is_complete(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory was finished: its completion marker is there and readable."""
    return read_marker(path) is not None


def read_marker(path: str | os.PathLike) -> dict | None:
    """The completion marker's content, or None when the directory is half-written."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def write_marker(path: str | os.PathLike, step: int, wandb_run_id: str | None) -> None:
    """Write the completion marker (last, and itself through a rename, so it is whole or absent)."""
    final = Path(path) / MARKER
    tmp = final.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "time": time.time(), "wandb_run_id": wandb_run_id}))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def scan(output_dir: str | os.PathLike) -> tuple[list[tuple[int, Path]], list[Skipped]]:
    """(complete checkpoints as (step, path) sorted by step, half-written ones) in output_dir."""
    root = Path(output_dir)
    complete: list[tuple[int, Path]] = []
    skipped: list[Skipped] = []
    if not root.is_dir():
        return complete, skipped
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if m := _CHECKPOINT.match(entry.name):
            if is_complete(entry):
                complete.append((int(m.group(1)), entry))
            else:
                skipped.append(Skipped(entry, int(m.group(1)), f"no {MARKER}: it was being written when the run "
                                                               "stopped"))
        elif m := _TMP.match(entry.name):
            skipped.append(Skipped(entry, int(m.group(1)), "a temporary directory: the run stopped while writing it"))
    return sorted(complete), sorted(skipped, key=lambda s: s.step)


def find_resumable_checkpoint(output_dir: str | os.PathLike) -> tuple[Path | None, list[Skipped]]:
    """The newest complete checkpoint of output_dir (None if there is none) and the half-written
    directories newer than it, which resume=auto passes over."""
    complete, skipped = scan(output_dir)
    newest = complete[-1] if complete else None
    newer = [s for s in skipped if newest is None or s.step >= newest[0]]
    return (newest[1] if newest else None), newer


def publish(tmp: Path, final: Path) -> None:
    """Move a finished checkpoint from its temporary name to its final one. A same-step checkpoint
    already there (the stop path saving a step already saved) is replaced, never merged."""
    if final.exists():
        old = final.with_name(f"tmp-old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def rotate(output_dir: str | os.PathLike, limit: int | None, protect: list[Path] = ()) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `limit` (None or <= 0: keep all) and the half-written
    directories older than the newest complete checkpoint. Never deletes the newest complete checkpoint
    or a path in `protect` (the one just written, the best model). Returns what was deleted."""
    complete, skipped = scan(output_dir)
    if not complete:
        return []
    keep = {complete[-1][1].resolve(), *(Path(p).resolve() for p in protect)}
    doomed = [s.path for s in skipped if s.step < complete[-1][0]]
    if limit is not None and limit > 0:
        keep.update(p.resolve() for _, p in complete[-limit:])
        doomed += [p for _, p in complete if p.resolve() not in keep]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
