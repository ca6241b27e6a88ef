"""A killed kernel build never blocks a later one, and a library is never loaded from where others can write
(rollout/runtime/model/kernels/build.py, trust.py).

torch's extension builder waits with no timeout on a lock file that a killed build leaves behind, so one
kill -9 mid-build used to hang every later process on the machine in `kernels.available()`, silently. These
tests inject the faults for real: a build process SIGKILLed mid-compile, a planted lock of a dead process
next to a torn library, a lock held by a live process, a cache directory writable by group and others. The
builds are of a one-function library: torch's headers where a build must last long enough to be killed (a few
seconds), plain C elsewhere (under a second); each with a name of its own, since a torch library namespace
registers once per process."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlspec.rollout.runtime.model import kernels
from rlspec.rollout.runtime.model.kernels.build import LOCK_TIMEOUT_ENV, BuildBusy, build_turn, load_library

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="flock and the extension builder: Linux")

TINY = """
#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x.mul(2); }
TORCH_LIBRARY(NS, m) { m.def("twice(Tensor x) -> Tensor", twice); }
"""

PLAIN = 'extern "C" int NS_twice(int x) { return 2 * x; }\n'

CHILD = """
import sys
from pathlib import Path
from rlspec.rollout.runtime.model.kernels.build import load_library
load_library(sys.argv[1], [Path(sys.argv[2])], [], [], Path(sys.argv[3]))
"""


def _tiny(tmp_path: Path, ns: str, source: str = PLAIN) -> Path:
    src = tmp_path / f"{ns}.cpp"
    src.write_text(source.replace("NS", ns))
    return src


def _works(ns: str, lib: Path | None = None) -> bool:
    """The torch op (TINY), or with lib the plain C function (PLAIN), doubles."""
    if lib is None:
        return torch.equal(getattr(torch.ops, ns).twice(torch.ones(3)), torch.full((3,), 2.0))
    return getattr(ctypes.CDLL(str(lib)), f"{ns}_twice")(21) == 42


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_build_killed_mid_compile_frees_the_next_one_at_once(tmp_path, monkeypatch, capsys):
    ns, cache = "rlspec_test_killed", tmp_path / "cache"
    src = _tiny(tmp_path, ns, TINY)  # torch's headers: a compile long enough to be killed in
    child = subprocess.Popen([sys.executable, "-c", CHILD, ns, str(src), str(cache)], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 120
    while not list(cache.glob(f".build-{ns}-*/build.ninja")):  # torch wrote its ninja file: compiling now
        assert child.poll() is None and time.monotonic() < deadline, "the build ended before it could be killed"
        time.sleep(0.05)
    time.sleep(1.0)
    child.send_signal(signal.SIGKILL)  # as kill -9 or the OOM killer: no Python runs, the compilers live on
    child.wait()
    assert list(cache.glob(f".build-{ns}-*"))  # its half-built private directory is left behind
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "60")  # a regression fails with BuildBusy instead of hanging
    lib = load_library(ns, [src], [], [], cache)
    assert lib == cache / f"{ns}.so" and _works(ns)
    assert "waiting" not in capsys.readouterr().out  # the dead build's lock did not hold us for a moment
    assert not list(cache.glob(f".build-{ns}-*"))  # and its leftovers are gone


def test_a_dead_process_s_lock_and_a_torn_library_are_rebuilt_without_waiting(tmp_path, capsys):
    ns, cache = "rlspec_test_torn", tmp_path / "cache"
    src = _tiny(tmp_path, ns)
    cache.mkdir(mode=0o700)
    (cache / f"{ns}.lock").write_text(f"{_dead_pid()}\n")  # our lock, from a process long gone
    (cache / "lock").write_text("")  # torch's own lock file, as a killed build of the old scheme left it
    (cache / f"{ns}.so").write_bytes(b"\x7fELF torn off mid-link")
    with pytest.warns(UserWarning, match="does not load"):
        lib = load_library(ns, [src], [], [], cache)
    assert _works(ns, lib) and lib.read_bytes()[:4] == b"\x7fELF" and lib.stat().st_size > 1000
    assert "waiting" not in capsys.readouterr().out


def test_a_live_build_is_waited_for_with_one_message_then_given_up(tmp_path, monkeypatch, capsys):
    ns, cache = "rlspec_test_busy", tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "1")
    with build_turn(cache / f"{ns}.lock", timeout=1):  # another process building, still alive
        t0 = time.monotonic()
        with pytest.raises(BuildBusy, match=f"process {os.getpid()} has been building"):
            load_library(ns, [_tiny(tmp_path, ns)], [], [], cache)
        assert time.monotonic() - t0 < 10
    out = capsys.readouterr().out
    assert out.count("waiting up to 1 s") == 1 and str(cache / f"{ns}.lock") in out


def test_a_cache_others_can_write_is_not_loaded_from(tmp_path):
    ns, shared = "rlspec_test_shared", tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    planted = shared / f"{ns}.so"
    planted.write_bytes(b"someone else's code")
    with pytest.warns(UserWarning, match="writable by group and others"):
        lib = load_library(ns, [_tiny(tmp_path, ns)], [], [], shared)
    assert _works(ns, lib) and not lib.is_relative_to(shared)  # built privately for this process
    assert planted.read_bytes() == b"someone else's code" and not lib.parent.exists()  # nothing left behind


def test_the_real_kernels_load_past_a_build_lock_left_by_a_killed_build(tmp_path):
    """The fault as reported: torch's lock file left in the kernels' build directory. Loading used to wait on
    it forever; the built library is now loaded without looking at it."""
    if not kernels.available():
        pytest.skip("no AVX-512 BF16 CPU or no C++ toolchain")
    from rlspec.rollout.runtime.model.fetch import cache_root

    digest = kernels.source_digest()
    name, built = f"rlspec_kernels_{digest}", cache_root() / "kernels" / digest
    if not (built / f"{name}.so").is_file():
        pytest.skip(f"the kernels were not built under {built}")
    planted = tmp_path / "kernels" / digest
    planted.mkdir(parents=True)
    shutil.copy2(built / f"{name}.so", planted / f"{name}.so")
    (planted / "lock").write_text("")
    (planted / f"{name}.lock").write_text(f"{_dead_pid()}\n")
    code = "from rlspec.rollout.runtime.model import kernels; assert kernels.available()"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=str(ROOT), RLSPEC_CACHE=str(tmp_path)))


def test_a_cache_reached_through_a_link_loads_the_library_built_there(tmp_path, monkeypatch):
    """A trusted cache directory reached through a symbolic link (tests/conftest.py's fresh caches link to the
    machine's kernels) loads the library already built behind it: no build. Comparing the resolved path with the
    link's made every such process build privately again (~20 s each: the distributed tests' warm starts ran out
    of their budget before a step)."""
    import rlspec.rollout.runtime.model.kernels.build as build

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    load_library("rlspec_linked_once", [_tiny(tmp_path, "rlspec_linked_once")], [], [], real)  # the machine's build
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    compiled = []
    monkeypatch.setattr(build, "_compile_into", lambda *a: compiled.append(a))
    assert load_library("rlspec_linked_once", [tmp_path / "rlspec_linked_once.cpp"], [], [], link) == \
        real / "rlspec_linked_once.so"
    assert compiled == [] and _works("rlspec_linked_once", real / "rlspec_linked_once.so")
