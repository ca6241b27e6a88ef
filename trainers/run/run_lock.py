"""One process per output_dir: a lock file holding a lease, renewed while the run lives.

    <output_dir>/rlspec.lock    {"host", "pid", "start", "boot_id", "time", "heartbeat", "lease_s"}: the
                                holder's host name, pid, the process's start time (from /proc, to tell a reused
                                pid), the host's boot id, when it took the lock, and when it last renewed it

A supervisor that restarts a job while the old process still writes its SIGTERM checkpoint would otherwise run
two processes on one directory. `hold(output_dir)` takes the lock for a block (the CLI's whole run, `train()`
of a trainer) and refuses with OutputDirLocked (exit code 2) when another process holds it:

- the file is also flock()ed while held, so among live processes on one host exactly one wins, and the kernel
  drops the flock when its holder dies, however it dies;
- a thread renews the heartbeat every lease/6 seconds while the lock is held;
- a lock whose holder is on this host and no longer runs (kill -9, OOM), or ran before this host's last boot,
  is taken over, with a line saying so;
- a lock of another host (a Slurm requeue, a new pod) is taken over once its heartbeat is older than the lease
  (RLSPEC_LOCK_LEASE_S, default 300 s), with a line saying so; a fresher one is refused;
- where flock() is not supported (ENOLCK: NFSv3 without lockd, Lustre mounted noflock), the lock file is
  created exclusively instead (O_EXCL), with the same lease and take-over rules.
The lock file is never followed through a symlink. Re-entrant within a process (the CLI holds it, then the
trainer's train() takes it again).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from rlspec.trainers.run.run_files import LOCK

try:
    import fcntl
except ImportError:  # not POSIX: the exclusive-create lock alone
    fcntl = None

DEFAULT_LEASE_S = 300.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", -1)}
_held: dict[str, "_Held"] = {}  # resolved output_dir -> what this process holds


class OutputDirLocked(RuntimeError):
    """Another process holds output_dir's lock. exit_code: what the CLI exits with (refused before step 1)."""

    exit_code = 2


def lease_s() -> float:
    """How old a holder's heartbeat may be before another host takes the lock over (RLSPEC_LOCK_LEASE_S)."""
    raw = os.environ.get("RLSPEC_LOCK_LEASE_S", "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_LEASE_S
    except ValueError:
        raise OutputDirLocked(f"RLSPEC_LOCK_LEASE_S={raw!r} is not a number of seconds (e.g. 300)") from None
    if not value > 0:
        raise OutputDirLocked(f"RLSPEC_LOCK_LEASE_S={raw!r} must be > 0 seconds (e.g. 300)")
    return value


class _Held:
    def __init__(self, root: Path, fd: int, exclusive: bool):
        self.root, self.fd, self.exclusive, self.depth = root, fd, exclusive, 1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="rlspec-lock-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        period = max(lease_s() / 6, 0.05)
        while not self.stop.wait(period):
            try:
                if os.stat(self.root / LOCK, follow_symlinks=False).st_ino != os.fstat(self.fd).st_ino:
                    print(f"rlspec: the lock {self.root / LOCK} was taken over by another process (this one did not "
                          "renew it within its lease): two runs may now write this output_dir", file=sys.stderr,
                          flush=True)
                    return
                _write(self.fd, _mine())
            except OSError:  # a network file system gone for a while: try again at the next beat
                continue


@contextlib.contextmanager
def hold(output_dir: str | os.PathLike):
    """Hold output_dir's lock for the block (creating output_dir if needed)."""
    key = str(Path(output_dir).expanduser().resolve())
    if key in _held:
        _held[key].depth += 1
    else:
        fd, exclusive = acquire(Path(key))
        _held[key] = _Held(Path(key), fd, exclusive)
    try:
        yield
    finally:
        held = _held[key]
        held.depth -= 1
        if held.depth == 0:
            _held.pop(key)
            held.stop.set()
            held.thread.join(timeout=5)
            release(Path(key), held.fd)


def acquire(root: Path) -> tuple[int, bool]:
    """Take root's lock: (its open descriptor, keep it open while holding; whether it is the exclusive-create
    kind), or raise OutputDirLocked."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if (root / LOCK).is_symlink():
            raise OutputDirLocked(f"{root / LOCK} is a symlink: rlspec never writes through one in output_dir; "
                                  "remove it and start again")
        fd = _acquire_flock(root)
        return (fd, False) if fd is not None else (_acquire_exclusive(root), True)
    except OSError as exc:  # a file system that refuses even a plain lock file: a clear stop, not a traceback
        raise OutputDirLocked(f"output_dir {root}: cannot create the lock file {root / LOCK} ({exc}); choose an "
                              "output_dir on a file system this process can write") from None


def _acquire_flock(root: Path) -> int | None:
    """The flock()ed lock file's descriptor; None where flock() is not supported."""
    path = root / LOCK
    for _ in range(5):
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR | _NOFOLLOW), False
            except FileNotFoundError:
                continue  # released meanwhile
        got = _flock(fd)
        if got is None:
            if created:  # an empty file of ours would read as a holder to the exclusive-create lock
                os.unlink(path)
            os.close(fd)
            print(f"rlspec: {path}: flock is not supported on this file system; using an exclusively created "
                  f"lock file with a {lease_s():.0f} s lease instead", file=sys.stderr, flush=True)
            return None
        if not got:
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
    why = _stale(holder, os.fstat(fd).st_mtime) if holder else None
    if holder and why is None:
        os.close(fd)
        raise OutputDirLocked(_message(root, holder, running=False))
    if holder:
        print(f"rlspec: taking over {path}: {why}", file=sys.stderr, flush=True)
    _write(fd, _mine())
    return fd


def _acquire_exclusive(root: Path) -> int:
    """The lock as a file created with O_EXCL (for file systems without flock); a stale one is renamed aside
    first (one rename wins when two processes take over at once)."""
    path = root / LOCK
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
            except FileNotFoundError:
                continue  # released meanwhile
            holder, mtime = _read(fd), os.fstat(fd).st_mtime
            os.close(fd)
            if holder is None and time.time() - mtime < 5:
                time.sleep(0.2)  # just created, not written yet
                continue
            why = _stale(holder, mtime) if holder else "the file is empty"
            if why is None:
                raise OutputDirLocked(_message(root, holder, running=False))
            aside = path.with_name(f"{LOCK}.stale-{os.getpid()}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue  # another process took it over first
            os.unlink(aside)
            print(f"rlspec: taking over {path}: {why}", file=sys.stderr, flush=True)
            continue
        _write(fd, _mine())
        return fd
    raise OutputDirLocked(f"output_dir {root}: could not take {path} (it keeps changing); try again")


def release(root: Path, fd: int) -> None:
    """Remove the lock file (while still holding it, so no one takes a file about to vanish), then let go."""
    with contextlib.suppress(OSError):
        if os.stat(root / LOCK, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            os.unlink(root / LOCK)
    os.close(fd)


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this file system has no flock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return None
        raise


def _mine() -> dict:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid()),
            "boot_id": boot_id(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "heartbeat": now,
            "lease_s": lease_s()}


def _write(fd: int, holder: dict) -> None:
    raw = json.dumps(holder).encode()
    os.pwrite(fd, raw, 0)
    os.ftruncate(fd, len(raw))  # after the write: a reader never sees an empty file of a live holder
    os.fsync(fd)


def _read(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return {"pid": None, "host": None, "raw": raw[:200].decode(errors="replace")}
    if holder is None or isinstance(holder, dict):  # None: an empty file, just created
        return holder
    return {"pid": None, "host": None, "raw": str(holder)[:200]}


def heartbeat_age(holder: dict, mtime: float) -> float:
    """Seconds since the holder last renewed the lock: its "heartbeat" (seconds since the epoch, or a date),
    else the file's modification time."""
    beat = next((holder[k] for k in ("heartbeat", "heartbeat_time", "last_heartbeat") if k in holder), None)
    when = None
    if isinstance(beat, (int, float)) and not isinstance(beat, bool):
        when = float(beat)
    elif isinstance(beat, str):
        with contextlib.suppress(ValueError):
            when = float(beat)
        if when is None:
            from datetime import datetime

            with contextlib.suppress(ValueError):
                when = datetime.fromisoformat(beat).timestamp()
    return time.time() - (mtime if when is None else when)


def _stale(holder: dict, mtime: float) -> str | None:
    """Why a lock file's holder is gone (None: it may still run). On this host: its pid runs no more (or runs
    another process, one started at another time), or it ran before this host's last boot. On another host (or
    an unreadable holder): its heartbeat is older than the lease."""
    pid, same_host = holder.get("pid"), holder.get("host") == socket.gethostname()
    if same_host and isinstance(pid, int):
        if holder.get("boot_id") and boot_id() and holder["boot_id"] != boot_id():
            return f"its holder, pid {pid} on this host, ran before this host's last boot"
        if pid == os.getpid():  # our own pid, yet not held by this process: a leftover
            return f"its holder, pid {pid} on this host, no longer runs"
        start = holder.get("start")
        if not pid_alive(pid) or (start is not None and process_start(pid) not in (None, start)):
            return f"its holder, pid {pid} on this host, no longer runs"
        return None
    age, lease = heartbeat_age(holder, mtime), lease_s()
    if age > lease:
        return (f"its holder, pid {pid} on host {holder.get('host')}, last renewed it {age:.0f} s ago, beyond the "
                f"{lease:.0f} s lease (RLSPEC_LOCK_LEASE_S)")
    return None


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


def boot_id() -> str | None:
    """This host's boot id (Linux), None where unknown: a pid of an earlier boot names no process of this one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
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
    lease = lease_s()
    age = heartbeat_age(holder, path.stat().st_mtime if path.exists() else time.time())
    return (f"output_dir {root} is locked by pid {pid} on host {host} (since {since}; its heartbeat is {age:.0f} s "
            f"old, the lease {lease:.0f} s). rlspec cannot tell from here whether a process on another host still "
            f"runs, so it never takes that lock over while its heartbeat is fresh: it is taken over once the "
            f"heartbeat is older than the lease (RLSPEC_LOCK_LEASE_S); if that run is known to be gone, delete "
            f"{path} and start again; otherwise choose another output_dir.")
