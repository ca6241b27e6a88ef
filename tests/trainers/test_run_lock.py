"""rlspec.trainers.run.run_lock: one process per output_dir. Planted locks (a dead pid, a live pid, another host) and a real
holder process killed with SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlspec.trainers.run import run_lock
from rlspec.trainers.run.run_files import LOCK

REPO = Path(__file__).resolve().parents[2]


def _plant(root: Path, **holder) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / LOCK).write_text(json.dumps({"time": "2026-11-28 00:00:00", **holder}))
    return root / LOCK


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, capsys):
    _plant(tmp_path, host=socket.gethostname(), pid=_dead_pid())
    with run_lock.hold(tmp_path):
        holder = json.loads((tmp_path / LOCK).read_text())
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    assert "taking over" in capsys.readouterr().err
    assert not (tmp_path / LOCK).exists()  # released: removed


def test_a_lock_of_a_live_process_on_this_host_is_refused(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        planted = _plant(tmp_path, host=socket.gethostname(), pid=live.pid)
        with pytest.raises(run_lock.OutputDirLocked, match=rf"in use by pid {live.pid} on this host"):
            with run_lock.hold(tmp_path):
                pass
        assert json.loads(planted.read_text())["pid"] == live.pid  # left as it was
    finally:
        live.kill()
        live.wait()


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path):
    """The recorded pid runs, but as another process (its start time differs): the holder is gone."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = run_lock.process_start(live.pid)
        if start is None:
            pytest.skip("no /proc here")
        _plant(tmp_path, host=socket.gethostname(), pid=live.pid, start=start - 1)
        with run_lock.hold(tmp_path):
            assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    finally:
        live.kill()
        live.wait()


def test_another_hosts_lock_is_never_taken_over(tmp_path):
    planted = _plant(tmp_path, host="another-host.example", pid=_dead_pid())
    with pytest.raises(run_lock.OutputDirLocked, match="never takes that lock over") as err:
        with run_lock.hold(tmp_path):
            pass
    assert "another-host.example" in str(err.value) and f"delete {planted}" in str(err.value)
    assert planted.is_file()


def test_a_running_holder_excludes_others_until_it_is_killed(tmp_path):
    """A real second process holds the lock (flock and file): refused while it lives, taken over after kill -9;
    the lock is re-entrant within one process."""
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from rlspec.trainers.run import run_lock\n"
            f"with run_lock.hold({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.OutputDirLocked, match=f"pid {holder.pid}"):
            with run_lock.hold(tmp_path):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.time() + 10
    while run_lock.pid_alive(holder.pid) and time.time() < deadline:
        time.sleep(0.05)
    with run_lock.hold(tmp_path):
        with run_lock.hold(tmp_path / "." ):  # re-entrant: the CLI holds it, then the trainer's train()
            assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
        assert (tmp_path / LOCK).is_file()  # still held by the outer block
    assert not (tmp_path / LOCK).exists()


def test_another_hosts_lock_with_an_old_heartbeat_is_taken_over_a_fresh_one_refused(tmp_path, capsys, monkeypatch):
    """A Slurm requeue on another node: the old node's lock, its heartbeat an hour old, is taken over with a
    line; one renewed a second ago is refused; with a short lease (RLSPEC_LOCK_LEASE_S) it ages out."""
    _plant(tmp_path, host="other-node", pid=4242, heartbeat=time.time() - 3600)
    with run_lock.hold(tmp_path):
        holder = json.loads((tmp_path / LOCK).read_text())
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
        assert holder["boot_id"] == run_lock.boot_id() and holder["heartbeat"] > time.time() - 60
    err = capsys.readouterr().err
    assert "taking over" in err and "other-node" in err and "beyond the 300 s lease" in err
    planted = _plant(tmp_path, host="other-node", pid=4242, heartbeat=time.time() - 1)
    with pytest.raises(run_lock.OutputDirLocked, match="heartbeat is 1 s old, the lease 300 s"):
        with run_lock.hold(tmp_path):
            pass
    assert json.loads(planted.read_text())["pid"] == 4242
    # no heartbeat field (an older rlspec): the file's modification time is the heartbeat
    monkeypatch.setenv("RLSPEC_LOCK_LEASE_S", "30")
    _plant(tmp_path, host="other-node", pid=4242)
    os.utime(tmp_path / LOCK, (time.time() - 60, time.time() - 60))
    with run_lock.hold(tmp_path):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()


def test_a_lock_of_this_host_before_its_last_boot_is_taken_over(tmp_path, capsys):
    if run_lock.boot_id() is None:
        pytest.skip("no boot id here")
    _plant(tmp_path, host=socket.gethostname(), pid=os.getppid(), boot_id="an-earlier-boot")  # pid runs again
    with run_lock.hold(tmp_path):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert "before this host's last boot" in capsys.readouterr().err


def test_the_heartbeat_renews_the_lease_while_held(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSPEC_LOCK_LEASE_S", "0.6")
    with run_lock.hold(tmp_path):
        first = json.loads((tmp_path / LOCK).read_text())["heartbeat"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LOCK).read_text())["heartbeat"] > first


def _no_flock(monkeypatch):
    import errno

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", flock)


def test_without_flock_an_exclusive_lock_file_with_the_same_lease_is_used(tmp_path, monkeypatch, capsys):
    """ENOLCK (NFSv3 without lockd, Lustre noflock): the lock is an O_EXCL file; a live holder is refused, a
    stale one of another host taken over; never an OSError."""
    _no_flock(monkeypatch)
    with run_lock.hold(tmp_path):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert "flock is not supported" in capsys.readouterr().err and not (tmp_path / LOCK).exists()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _plant(tmp_path, host=socket.gethostname(), pid=live.pid, heartbeat=time.time() - 3600)
        with pytest.raises(run_lock.OutputDirLocked, match=f"in use by pid {live.pid} on this host"):
            with run_lock.hold(tmp_path):
                pass
    finally:
        live.kill()
        live.wait()
    _plant(tmp_path, host="other-node", pid=4242, heartbeat=time.time() - 3600)
    with run_lock.hold(tmp_path):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert "taking over" in capsys.readouterr().err
    _plant(tmp_path, host="other-node", pid=4242, heartbeat=time.time())
    with pytest.raises(run_lock.OutputDirLocked, match="other-node"):
        with run_lock.hold(tmp_path):
            pass


def test_a_symlinked_lock_file_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("mine")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / LOCK).symlink_to(target)
    with pytest.raises(run_lock.OutputDirLocked, match="symlink"):
        with run_lock.hold(tmp_path / "out"):
            pass
    assert target.read_text() == "mine"
