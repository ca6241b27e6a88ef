"""Build (once a machine) and load a C++ op library, never waiting on a dead build.

torch's extension builder (torch.utils.cpp_extension.load) guards its build directory with a lock file that it
creates, and that a later call waits on with no timeout: a build killed half-way (kill -9, the OOM killer, a
second Ctrl-C, a Ray pool torn down) leaves the file behind, and every later process on the machine then waits
forever, printing nothing. So `load_library`:
  * loads <dir>/<name>.so without any lock once it is there (the common case);
  * else takes its turn through an flock on <dir>/<name>.lock. The kernel drops an flock when its holder dies,
    however it dies, so a killed build frees the next process at once; a live holder is waited for at most
    $RLSPEC_KERNEL_LOCK_TIMEOUT seconds (default 300, one message while waiting), then `BuildBusy` is raised
    and the caller runs without the kernels;
  * builds in a fresh private directory (mkdtemp) that no other process looks at, so torch's own lock there is
    never contended, and renames the library into place: a reader sees a whole library or none. The private
    directories of killed builds are removed by the next build, which holds the lock, so none of them is live;
  * uses <dir> only when no other user can change it (trust.py); anywhere else it builds in a private temporary
    directory for this process, with a warning.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator

import torch

from rlspec.rollout.runtime.model.kernels.trust import private_dir, untrusted_reason

LOCK_TIMEOUT_ENV = "RLSPEC_KERNEL_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 300.0  # a first build takes ~30 s on a free machine, minutes on a loaded one


class BuildBusy(TimeoutError):
    """Another live process has held the build lock for longer than this process will wait."""


def lock_timeout() -> float:
    return float(os.environ.get(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT))


def load_library(name: str, sources: list[Path], cflags: list[str], ldflags: list[str], directory: Path) -> Path:
    """Load the op library `name` built from `sources`, from `directory` (building it there first if missing);
    returns the path it was loaded from."""
    where = private_dir(directory, "the CPU kernels' library")
    lib = where / f"{name}.so"
    # private_dir returns the trusted path resolved (a cache reached through a link, as tests/conftest.py's, is the
    # directory the link names) or a fresh private one: only the latter builds just for this process
    if where != Path(os.path.realpath(directory)):  # others can write there: build for this process, leave nothing
        try:
            _compile_into(where, lib, name, sources, cflags, ldflags)
        finally:
            shutil.rmtree(where, ignore_errors=True)  # the loaded library stays mapped
        return lib
    if _try_load(lib):
        return lib
    with build_turn(where / f"{name}.lock", lock_timeout()):
        if _try_load(lib):  # the process we waited for built it
            return lib
        for leftover in where.glob(f".build-{name}-*"):  # we hold the lock: these builds were killed
            shutil.rmtree(leftover, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=where))
        try:
            _compile_into(scratch, lib, name, sources, cflags, ldflags)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return lib


def _compile_into(scratch: Path, lib: Path, name: str, sources: list[Path], cflags: list[str],
                  ldflags: list[str]) -> None:
    """Build in `scratch` (loading the result into this process), then rename the library to `lib`.

    The sources are compiled as one translation unit (a file in `scratch` that includes them all): each of them
    spends most of its compile parsing ATen's headers, so one unit builds the six of them in 14 s on one core,
    where six units took 78 s (40 s on two cores, which the tests' second worker needs meanwhile). Their file-level
    names must therefore not collide (the compiler says so if they do)."""
    from torch.utils.cpp_extension import load

    unit = scratch / f"{name}.cpp"
    unit.write_text("".join(f'#include "{p.resolve()}"\n' for p in sources))
    built = load(name=name, sources=[str(unit)], build_directory=str(scratch), extra_cflags=cflags,
                 extra_ldflags=ldflags, is_python_module=False, verbose=False)
    os.chmod(built, 0o755)  # whatever the umask: a group-writable library would fail the next load's check
    if Path(built) != lib:
        os.replace(built, lib)


def _try_load(lib: Path) -> bool:
    """Load `lib` if it is there, whole and ours; False sends the caller to (re)build it."""
    if not lib.is_file():
        return False
    reason = untrusted_reason(lib)
    if reason is not None:
        warnings.warn(f"rlspec: not loading {lib}: {reason}; rebuilding it", stacklevel=3)
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError as exc:  # torn by a build killed mid-link (before builds were renamed into place): rebuild
        warnings.warn(f"rlspec: {lib} does not load ({exc}); rebuilding it", stacklevel=3)
        return False
    return True


@contextlib.contextmanager
def build_turn(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive flock on `path` for the body: at once if free or its holder died, else after waiting up
    to `timeout` seconds for the live holder (BuildBusy past that). Where the file system has no flock, builds
    go ahead unlocked: their private directories and the atomic rename keep them apart anyway."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # close-on-exec: the compiler children never hold it
    try:
        deadline, told = time.monotonic() + timeout, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                if time.monotonic() >= deadline:
                    raise BuildBusy(f"process {holder} has been building the CPU kernels for over {timeout:.0f} s "
                                    f"(lock {path}); raise ${LOCK_TIMEOUT_ENV} to wait longer") from None
                if not told:
                    print(f"rlspec: waiting up to {timeout:.0f} s for process {holder}, which is building the CPU "
                          f"kernels (lock {path})", flush=True)
                    told = True
                time.sleep(0.2)
            except OSError:  # ENOLCK, EOPNOTSUPP: no flock on this file system
                break
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the waiters' message
        yield
    finally:
        os.close(fd)  # drops the flock
