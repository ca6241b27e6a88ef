"""ScratchDir: a temporary directory that goes away with its owner, its process, or at the next start.

The vLLM backend saves a full copy of the policy (and the drafter's exports) for vLLM to load from a
directory: gigabytes per run. A plain mkdtemp outlives a crash, and runs that die often (preempted
jobs, OOM kills) fill the disk. So every scratch directory lives under a per-process directory,
    <tempdir>/rlspec-<uid>/<pid>-<process start time>/<prefix><random>/
and is removed by
  - close() (the owner is done with it),
  - a weakref finalizer when the owner is garbage collected or the interpreter exits normally (an
    exception that ends the program included),
  - the next ScratchDir.create() in any process of this user, for processes no longer alive (a
    SIGKILL or an OOM kill runs no Python at all: nothing else can clean up after it). The start
    time in the name tells a dead process from a new one that got its pid (containers reuse pids).
The per-user directory has a predictable name in a shared /tmp, so another user could create it first and
plant the policy copy vLLM loads: it is used only as a real directory owned by this user with mode 0700
(`private_root`: one of ours is tightened, anyone else's or a symlink is refused for a fresh mkdtemp, with a
warning), and so is each per-process directory below it.
Nothing here depends on vLLM.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import weakref
from pathlib import Path

log = logging.getLogger(__name__)


def scratch_root() -> Path:
    """<tempdir>/rlspec-<uid>: one per user, so users never trip over each other's permissions."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"rlspec-{uid}"


def private_root(path: Path) -> Path:
    """`path` as a directory only this user can enter (created 0700, or tightened to 0700 if it is ours), or,
    where it is a symlink or someone else's, a fresh private directory instead (with a warning)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)  # lstat: a planted symlink to someone else's directory is not a directory of ours
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)  # ours but open to others (an older run, a umask): nobody else gets in now
        return path
    fallback = Path(tempfile.mkdtemp(prefix=f"{path.name}-"))
    log.warning("%s is %s, not a directory of this user (uid %s): another user could plant the model vLLM loads "
                "there, so this run uses %s instead. Remove %s to get the usual place back.", path,
                "a symlink" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}", os.getuid(), fallback,
                path)
    return fallback


def process_tag(pid: int | None = None) -> str | None:
    """"<pid>-<start time in clock ticks since boot>" of a live process (Linux /proc; elsewhere the
    start time reads 0), or None if no such process exists."""
    pid = os.getpid() if pid is None else pid
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # exists, someone else's
    try:  # field 22 of /proc/<pid>/stat, counted after the ")" that ends the command name
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = "0"
    return f"{pid}-{start}"


def sweep_stale(root: Path) -> list[Path]:
    """Remove the per-process directories under `root` whose process is gone; returns what was removed."""
    removed = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        pid, _, start = d.name.partition("-")
        if d.is_dir() and pid.isdigit() and start.isdigit() and process_tag(int(pid)) != d.name:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            log.warning("removed %s, left behind by process %s, which is gone", d, pid)
    return removed


class ScratchDir:
    """A directory removed on close(), when its owner is collected, at exit, or after a crash (above)."""

    def __init__(self, path: Path):
        self.path = path
        self._finalizer = weakref.finalize(self, _remove, path)

    @classmethod
    def create(cls, prefix: str = "scratch-", root: Path | None = None) -> "ScratchDir":
        """Sweep the dead processes' leftovers, then make a fresh directory under this process's own."""
        root = private_root(root or scratch_root())
        sweep_stale(root)
        mine = private_root(root / process_tag())
        return cls(Path(tempfile.mkdtemp(prefix=prefix, dir=mine)))

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the directory now (idempotent)."""
        self._finalizer()


def _remove(path: Path) -> None:
    """The directory, then its per-process parent if nothing else of this process is left in it."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass  # another scratch directory of this process is still in use
