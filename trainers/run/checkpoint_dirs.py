"""The checkpoint directories of a run's output_dir: names, completeness, the newest complete one, rotation.

Plain files and names, no torch: the CLI reads these before any heavy import (resume=auto, the refusal
to start into a used output_dir). What a checkpoint holds and how it is written is trainers/run/checkpoint.py.

    checkpoint-N/               a checkpoint; complete only when it holds rlspec_complete.json
    checkpoint-N/rlspec_complete.json   written last: {"step", "time", "wandb_run_id", "finite", "files",
                                "digest"}: every file's size, and a checksum of that list
    tmp-checkpoint-N/           a checkpoint being written (renamed to checkpoint-N when complete)
    tmp-old-checkpoint-N/       a same-step checkpoint being replaced (publish(), between its two renames)
    abandoned-<date>-from-N/    checkpoints newer than N, set aside when a run resumed from N (an operator's
                                rollback), so that resume=auto and rotation never see that branch again

transformers' get_last_checkpoint and rotation match only `checkpoint-<digits>`, so they never see a
temporary directory; a checkpoint-N without the marker (a checkpoint written by a crashed run of an
older layout, a plain HF/TRL checkpoint, or a copy cut short) is skipped by resume=auto and reported.
Durable: every file and directory of a checkpoint is fsynced before its marker, the marker (itself fsynced)
is written last, and the rename is fsynced before rotation deletes anything; still, a file system may lose
data it acknowledged (a power loss on a cache that lies), so the scan trusts a marker only when the sizes it
lists match the files and its checksum matches: a torn checkpoint is skipped and reported like a
half-written one. scan() first finishes or undoes a publish() that a crash cut short (recover()). Rotation deletes complete
checkpoints (the marker is rlspec's) and half-written directories the run recorded in its manifest
(trainers/run/run_files.py), never an entry of the user's.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlspec.trainers.run import run_files

PREFIX = "checkpoint"
TMP_PREFIX = "tmp-checkpoint-"
OLD_PREFIX = "tmp-old-"
ABANDONED_PREFIX = "abandoned-"
MARKER = "rlspec_complete.json"
STATE_FILE = "rlspec_state.pt"
_CHECKPOINT = re.compile(rf"^{PREFIX}-(\d+)$")
_TMP = re.compile(rf"^{TMP_PREFIX}(\d+)$")
_OLD = re.compile(rf"^{OLD_PREFIX}{PREFIX}-(\d+)$")


@dataclass
class Skipped:
    """A directory resume=auto passed over, and why."""

    path: Path
    step: int
    reason: str
    kind: str = "half-written"  # or "damaged": marked complete, but its files do not match the marker

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}-{step}"


def is_complete(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory was finished: its completion marker is there and readable, and the
    files it lists are there with their sizes (verify())."""
    return read_marker(path) is not None and verify(path) is None


def read_marker(path: str | os.PathLike) -> dict | None:
    """The completion marker's content, or None when the directory is half-written."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def verify(path: str | os.PathLike) -> str | None:
    """Why a marked checkpoint cannot be trusted (None when it can): its marker's checksum does not match its
    file list, a listed file is missing or has another size (a write the disk lost after the marker: a power
    loss, a node reboot), or the marker says its weights were not finite. A marker without a file list (an
    older rlspec's) is trusted as it was."""
    root = Path(path)
    marker = read_marker(root)
    if marker is None:
        return f"no {MARKER}"
    if marker.get("finite") is False:
        return "its weights are not finite"
    files = marker.get("files")
    if files is None:
        return None
    if not isinstance(files, dict) or marker.get("digest") != _digest(files):
        return f"its {MARKER} does not match its own checksum"
    for rel, size in files.items():
        try:
            got = os.lstat(root / rel).st_size
        except OSError:
            return f"{rel} is missing (its {MARKER} lists it)"
        if got != size:
            return f"{rel} is {got} bytes, its {MARKER} recorded {size}: the write was lost after the marker"
    return None


def _digest(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def file_sizes(path: str | os.PathLike) -> dict[str, int]:
    """Every regular file under a directory (relative path -> size), the marker aside."""
    root = Path(path)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name not in (MARKER, MARKER + ".tmp")}


def sync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under path (and path itself): what the marker vouches for is on disk."""
    root = Path(path)
    for p in sorted(root.rglob("*"), reverse=True):  # files before the directories holding them
        if not p.is_symlink():
            fsync_path(p)
    fsync_path(root)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable: a rename, a new file)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    except OSError:  # a file system that cannot fsync a directory (some network ones): the files still were
        pass
    finally:
        os.close(fd)


def write_marker(path: str | os.PathLike, step: int, wandb_run_id: str | None, finite: bool | None = None,
                 **extra) -> None:
    """Write the completion marker last: the checkpoint's files are fsynced first, the marker lists their sizes
    (and a checksum of that list) and goes in through a rename, so it is whole or absent. finite: whether the
    weights were checked finite (None: not checked); extra: more keys (the batch geometry)."""
    root = Path(path)
    sync_tree(root)
    files = file_sizes(root)
    final = root / MARKER
    tmp = final.with_suffix(".tmp")
    body = {"step": step, "time": time.time(), "wandb_run_id": wandb_run_id, "files": files, "digest": _digest(files)}
    if finite is not None:
        body["finite"] = finite
    body.update(extra)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, json.dumps(body).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_path(root)


def scan(output_dir: str | os.PathLike) -> tuple[list[tuple[int, Path]], list[Skipped]]:
    """(complete checkpoints as (step, path) sorted by step, half-written ones) in output_dir, after recover()."""
    root = Path(output_dir)
    complete: list[tuple[int, Path]] = []
    skipped: list[Skipped] = []
    if not root.is_dir():
        return complete, skipped
    recover(root)
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if m := _CHECKPOINT.match(entry.name):
            if read_marker(entry) is not None and (why := verify(entry)) is not None:
                skipped.append(Skipped(entry, int(m.group(1)), f"marked complete, but {why}; resume=auto passes "
                                       "over it", kind="damaged"))
            elif is_complete(entry):
                complete.append((int(m.group(1)), entry))
            else:
                skipped.append(Skipped(entry, int(m.group(1)), f"no {MARKER}: it was being written when the run "
                                       "stopped, or rlspec did not write it; name it with resume=<dir> to resume "
                                       "from it if its files are whole"))
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


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """A checkpoint's step: its marker's, else trainer_state.json's global_step, else its name's."""
    path = Path(path)
    marker = read_marker(path)
    if marker is not None and isinstance(marker.get("step"), int):
        return marker["step"]
    try:
        return int(json.loads((path / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _CHECKPOINT.match(path.name)
        return int(m.group(1)) if m else None


def publish(tmp: Path, final: Path) -> None:
    """Move a finished directory from its temporary name to its final one. One already there (the stop path
    saving a step already saved, a second final model) is replaced, never merged: it goes to tmp-old-<name>
    first, so a crash between the two renames leaves both copies whole, and recover() finishes the job."""
    if final.exists():
        old = final.with_name(f"{OLD_PREFIX}{final.name}")
        run_files.record(final.parent, old.name)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(final.parent)  # the new copy's name is durable before the old copy goes
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_path(final.parent)


def recover(output_dir: str | os.PathLike) -> list[str]:
    """Finish or undo what a crash inside publish() left (returns one line per repair, also printed):

    - tmp-old-checkpoint-N beside checkpoint-N: the crash came after the second rename; the old copy goes;
    - tmp-old-checkpoint-N without checkpoint-N: the crash came between the renames; the new copy
      (tmp-checkpoint-N/checkpoint-N, complete) becomes checkpoint-N, else the old copy is put back;
    - a complete tmp-checkpoint-N/checkpoint-N without checkpoint-N: the crash came between the marker and
      the rename; the rename is done.
    Renames a concurrent peer already did are passed over (several ranks may scan at once)."""
    root, done = Path(output_dir), []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if not entry.exists():  # repaired with an earlier entry of the same step
            continue
        if m := _OLD.match(entry.name):
            done += _recover_step(root, int(m.group(1)), entry)
        elif (m := _TMP.match(entry.name)) and not (root / checkpoint_name(int(m.group(1)))).exists():
            done += _recover_step(root, int(m.group(1)), None)
    for line in done:
        print(f"rlspec: {line}", file=sys.stderr, flush=True)
    return done


def _recover_step(root: Path, step: int, old: Path | None) -> list[str]:
    final = root / checkpoint_name(step)
    staged = root / f"{TMP_PREFIX}{step}" / final.name
    if old is not None and final.exists():
        shutil.rmtree(old, ignore_errors=True)
        return [f"removed {old.name}, the copy {final.name} replaced (a save was cut short after its last rename)"]
    if is_complete(staged) and _try_replace(staged, final):
        shutil.rmtree(staged.parent, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return [f"published the complete {staged.parent.name}/{final.name} as {final.name} (a save was cut short "
                "before its last rename)"]
    if old is not None and _try_replace(old, final):
        return [f"put {old.name} back as {final.name} (a save replacing it was cut short)"]
    return []


def _try_replace(src: Path, dst: Path) -> bool:
    try:
        os.replace(src, dst)
        return True
    except FileNotFoundError:  # a peer did it first
        return False
    except OSError as exc:  # dst appeared meanwhile (a peer published it)
        if dst.exists():
            return False
        raise exc


def set_aside_newer(output_dir: str | os.PathLike, step: int) -> tuple[Path | None, list[Path]]:
    """Move every checkpoint (complete or half-written) newer than `step` into a new
    abandoned-<date>-from-<step>/ folder of output_dir, which scan and rotation never look into: a run that
    resumed from step `step` (an operator's rollback) is the branch resume=auto must continue. Returns the
    folder (None when nothing is newer) and what was moved."""
    root = Path(output_dir)
    complete, skipped = scan(root)
    newer = [p for s, p in complete if s > step] + [s.path for s in skipped if s.step > step]
    if not newer:
        return None, []
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    name = f"{ABANDONED_PREFIX}{stamp}-from-{step}"
    while (root / name).exists():
        n += 1
        name = f"{ABANDONED_PREFIX}{stamp}-from-{step}-{n}"
    run_files.record(root, name)
    (root / name).mkdir()
    for path in newer:
        with contextlib.suppress(FileNotFoundError):  # a peer process (a node of a shared disk) moved it first
            os.replace(path, root / name / path.name)
    return root / name, newer


def rotate(output_dir: str | os.PathLike, limit: int | None, protect: list[Path] = ()) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `limit` (None or <= 0: keep all) and the half-written
    directories older than the newest complete checkpoint that this run recorded in its manifest (never a
    user's). Never deletes the newest complete checkpoint, the newest one whose weights were checked finite, or
    a path in `protect` (the one just written, the best model, the one the run resumed from). Returns what was deleted."""
    complete, skipped = scan(output_dir)
    if not complete:
        return []
    keep = {complete[-1][1].resolve(), *(Path(p).resolve() for p in protect)}
    finite = [p for _, p in complete if (read_marker(p) or {}).get("finite") is True]
    if finite:  # the newest whose weights were checked finite stays, whatever newer ones hold
        keep.add(finite[-1].resolve())
    ours = set(run_files.recorded(output_dir))
    doomed = [s.path for s in skipped if s.step < complete[-1][0] and s.path.name in ours]
    if limit is not None and limit > 0:
        keep.update(p.resolve() for _, p in complete[-limit:])
        doomed += [p for _, p in complete if p.resolve() not in keep]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
