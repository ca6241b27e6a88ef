"""One process per output_dir: an advisory lock file naming its holder.

    <output_dir>/rlspec.lock    {"host", "pid", "start", "time"}: the holder's host name, pid, the process's
                                start time (from /proc, to tell a reused pid) and when it took the lock

A supervisor that restarts a job while the old process still writes its SIGTERM checkpoint would otherwise
run two processes on one directory. `hold(output_dir)` takes the lock for a block (the CLI's whole run,
`train()` of a trainer) and refuses with OutputDirLocked when another process holds it:

- the file is also flock()ed while held, so among live processes on one host exactly one wins, and the kernel
  drops the flock when its holder dies, however it dies;
- a lock whose holder is on this host and no longer runs (kill -9, OOM, power loss) is taken over, with a line
  saying so; a lock naming another host is never taken over: this host cannot see whether that process runs
  (the error says to delete the file once that run is known to be gone).
Re-entrant within a process (the CLI holds it, then the trainer's train() takes it again).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from rlspec.trainers.run_files import LOCK

try:
    import fcntl
except ImportError:  # not POSIX: the pid/host check alone
    fcntl = None

_held: dict[str, list] = {}  # resolved output_dir -> [fd, depth]


class OutputDirLocked(RuntimeError):
    """Another process holds output_dir's lock. exit_code: what the CLI exits with (refused before step 1)."""

    exit_code = 2


@contextlib.contextmanager
def hold(output_dir: str | os.PathLike):
    """Hold output_dir's lock for the block (creating output_dir if needed)."""
    key = str(Path(output_dir).expanduser().resolve())
    if key in _held:
        _held[key][1] += 1
    else:
        _held[key] = [acquire(Path(key)), 1]
    try:
        yield
    finally:
        _held[key][1] -= 1
        if _held[key][1] == 0:
            release(Path(key), _held.pop(key)[0])


def acquire(root: Path) -> int:
    """Take root's lock and return its open descriptor (keep it open while holding), or raise OutputDirLocked."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    for _ in range(5):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _flock(fd):
            holder = _read(fd)
            os.close(fd)
            raise OutputDirLocked(_message(root, holder, running=True))
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:  # not unlinked by a holder releasing meanwhile
                break
        os.close(fd)
    else:
        raise OutputDirLocked(f"output_dir {root}: could not take {path} (it keeps changing); try again")
    holder = _read(fd)
    if holder and not _stale(holder):
        os.close(fd)
        raise OutputDirLocked(_message(root, holder, running=False))
    if holder:
        print(f"rlspec: taking over {path}: its holder, pid {holder.get('pid')} on this host, no longer runs",
              file=sys.stderr, flush=True)
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid()),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(mine).encode(), 0)
    os.fsync(fd)
    return fd


def release(root: Path, fd: int) -> None:
    """Remove the lock file (while still holding it, so no one takes a file about to vanish), then let go."""
    with contextlib.suppress(OSError):
        if os.stat(root / LOCK).st_ino == os.fstat(fd).st_ino:
            os.unlink(root / LOCK)
    os.close(fd)


def _flock(fd: int) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _read(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return {"pid": None, "host": None, "raw": raw[:200].decode(errors="replace")}
    if holder is None or isinstance(holder, dict):  # None: an empty file, just created
        return holder
    return {"pid": None, "host": None, "raw": str(holder)[:200]}


def _stale(holder: dict) -> bool:
    """Whether a lock file's holder is known to be gone: on this host, and its pid runs no more (or runs
    another process, one started at another time). Another host's holder is never known to be gone."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    pid = holder["pid"]
    if pid == os.getpid():  # our own pid, yet not held by this process (we got the flock): a leftover
        return True
    if not pid_alive(pid):
        return True
    start = holder.get("start")
    return start is not None and process_start(pid) not in (None, start)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _message(root: Path, holder: dict | None, running: bool) -> str:
    path = root / LOCK
    if not holder or holder.get("pid") is None:
        what = f"holds {holder.get('raw')!r}" if holder else "is held"
        return (f"output_dir {root} is in use by another process ({path} {what}). One process per output_dir: "
                "wait for it to end, stop it, or choose another output_dir.")
    pid, host, since = holder.get("pid"), holder.get("host"), holder.get("time", "an unknown time")
    if host == socket.gethostname() or running:
        where = f"this host ({host})" if host == socket.gethostname() else f"host {host}"
        return (f"output_dir {root} is in use by pid {pid} on {where}, since {since}. One process per "
                "output_dir: wait for it to end (a run stopped with SIGTERM writes its checkpoint first), stop it, "
                "or choose another output_dir.")
    return (f"output_dir {root} is locked by pid {pid} on host {host} (since {since}). rlspec cannot tell from "
            f"here whether a process on another host still runs, so it never takes that lock over: if that run "
            f"is gone, delete {path} and start again; otherwise choose another output_dir.")
