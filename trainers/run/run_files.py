"""The manifest of what rlspec wrote in an output_dir: overwrite and rotation delete nothing else.

    <output_dir>/rlspec-manifest.txt    one top-level name a line (checkpoint-20, tmp-checkpoint-20, final, ...)

A name is recorded *before* the entry is created, so an entry left by a crash mid-write is recorded too.
`overwrite_output_dir=true` deletes the recorded entries only (rlspec/resume.py), and rotation deletes a
half-written checkpoint only when it is recorded (trainers/run/checkpoint_dirs.py): a user's README.md,
notes/ or checkpoint-notes/ in the same directory is never touched. A name is recorded only when rlspec is about
to write it (claim()): a `drafter/` or `summary.json` of the user's already there is never claimed, so never
overwritten or deleted. The manifest is never written through a symlink. Plain files, no torch.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

MANIFEST = "rlspec-manifest.txt"
LOCK = "rlspec.lock"  # trainers/run/run_lock.py; named here so every listing of output_dir can leave both out
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
    fd = _open_nofollow(root / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, "".join(f"{n}\n" for n in new).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def claim(output_dir: str | os.PathLike, name: str) -> bool:
    """Record `name` before rlspec writes it, and say whether it may: False (nothing recorded) when an entry of
    that name is already there and rlspec did not write it (the user's, or a symlink): the caller skips it."""
    root = Path(output_dir)
    path = root / name
    if name in set(recorded(root)) and not path.is_symlink():
        return True
    if path.exists() or path.is_symlink():
        return False
    record(root, name)
    return True


def _open_nofollow(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        if path.is_symlink():
            raise OSError(exc.errno, f"{path} is a symlink: rlspec never writes through one in output_dir; "
                                     "remove it") from None
        raise


def forget(output_dir: str | os.PathLike, names: list[str]) -> None:
    """Drop names from the manifest (after their entries were deleted), through a rename."""
    root = Path(output_dir)
    keep = [n for n in recorded(root) if n not in set(names)]
    tmp = root / f"{MANIFEST}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover (or a planted symlink): the new file is created, never followed
    fd = _open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, "".join(f"{n}\n" for n in keep).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, root / MANIFEST)


def is_recorded(path: str | os.PathLike) -> bool:
    """Whether a top-level entry of an output_dir was written by rlspec (its name is in the manifest)."""
    path = Path(path)
    return path.name in set(recorded(path.parent))
