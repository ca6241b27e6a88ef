"""Directories this process may load compiled code from: ones no other user can change.

A library (our CPU kernels, inductor's compiled graphs) loaded from a directory that another user can write is
that user's code running as us: they swap the file, or rename a directory above it and put their own in its
place. So a cache directory is used only when it and every directory above it are owned by this user (or root)
and not writable by group or others; a sticky directory such as /tmp counts as safe, since there nobody can
rename or remove what another user owns. Anywhere else the caller gets a fresh private directory (mkdtemp,
mode 0700) for this process, with one warning that names the culprit and the fix.
"""
from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path


def untrusted_reason(path: str | os.PathLike) -> str | None:
    """Why other users could change what `path` holds, or None when they cannot. Checks the path itself (or,
    while it does not exist yet, the nearest existing directory above it) and every directory up to /."""
    uid = os.getuid()
    real = Path(os.path.realpath(path))  # after this no symlink is left to follow: each stat is the real thing
    for p in (real, *real.parents):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        if st.st_uid not in (uid, 0):
            return f"{p} is owned by uid {st.st_uid}, not by this user (uid {uid}) or root"
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        if st.st_mode & 0o022 and not sticky_dir:
            who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
            return f"{p} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}); `chmod go-w {p}` fixes that"
    return None


def make_private_dirs(path: Path) -> None:
    """mkdir -p with mode 0700 for every directory it creates (Path.mkdir(parents=True) gives the parents the
    umask's mode, which may be group-writable)."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:
            pass  # another process made it first: untrusted_reason still checks whose it is


def private_dir(path: Path, what: str) -> Path:
    """`path` (created 0700 where missing) when no other user can change it, else a new private temporary
    directory for this process, with a warning saying why. what: names the contents in the warning."""
    try:
        make_private_dirs(path)
        reason = untrusted_reason(path)
    except OSError as exc:
        reason = f"cannot create {path}: {exc}"
    if reason is None:
        return path
    fallback = Path(tempfile.mkdtemp(prefix="rlspec-private-"))
    atexit.register(shutil.rmtree, fallback, True)  # nobody else may use it: it goes with this process
    warnings.warn(f"rlspec: not using {path} for {what}: {reason}. Other users could replace the code loaded "
                  f"from there, so this process uses the private directory {fallback} instead (rebuilt each "
                  f"run). Fix the permissions, or point $RLSPEC_CACHE at a directory of your own.", stacklevel=2)
    return fallback
