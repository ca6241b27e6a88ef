"""The manifest of what rlspec wrote in an output_dir: overwrite and rotation delete nothing else.

    <output_dir>/rlspec-manifest.txt    one top-level name a line (checkpoint-20, tmp-checkpoint-20, final, ...)

A name is recorded *before* the entry is created, so an entry left by a crash mid-write is recorded too.
`overwrite_output_dir=true` deletes the recorded entries only (rlspec/resume.py), and rotation deletes a
half-written checkpoint only when it is recorded (trainers/checkpoint_dirs.py): a user's README.md,
notes/ or checkpoint-notes/ in the same directory is never touched. Plain files, no torch.
"""
from __future__ import annotations

import os
from pathlib import Path

MANIFEST = "rlspec-manifest.txt"
LOCK = "rlspec.lock"  # trainers/run_lock.py; named here so every listing of output_dir can leave both out
BOOKKEEPING = (MANIFEST, LOCK)


def recorded(output_dir: str | os.PathLike) -> list[str]:
    """The names recorded in output_dir's manifest, in the order they were written (empty without one)."""
    try:
        lines = (Path(output_dir) / MANIFEST).read_text().splitlines()
    except OSError:
        return []
    return list(dict.fromkeys(n for n in lines if n and "/" not in n and n not in (".", "..")))


def record(output_dir: str | os.PathLike, *names: str) -> None:
    """Append names not yet recorded (call before creating the entries). Creates output_dir if needed."""
    root = Path(output_dir)
    new = [n for n in dict.fromkeys(names) if n not in set(recorded(root))]
    if not new:
        return
    root.mkdir(parents=True, exist_ok=True)
    # one small O_APPEND write: a crash leaves the old lines whole (a torn last line names nothing that exists)
    fd = os.open(root / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(f"{n}\n" for n in new).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def forget(output_dir: str | os.PathLike, names: list[str]) -> None:
    """Drop names from the manifest (after their entries were deleted), through a rename."""
    root = Path(output_dir)
    keep = [n for n in recorded(root) if n not in set(names)]
    tmp = root / f"{MANIFEST}.tmp"
    tmp.write_text("".join(f"{n}\n" for n in keep))
    os.replace(tmp, root / MANIFEST)


def is_recorded(path: str | os.PathLike) -> bool:
    """Whether a top-level entry of an output_dir was written by rlspec (its name is in the manifest)."""
    path = Path(path)
    return path.name in set(recorded(path.parent))
