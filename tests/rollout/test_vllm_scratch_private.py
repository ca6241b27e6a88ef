"""The vLLM backend's scratch directories are private (rollout/vllm_backend/scratch.py).

<tempdir>/rlspec-<uid> has a predictable name in a shared /tmp: another user can create it before us, as a
directory of theirs or a symlink to one, and plant the policy copy vLLM loads. These tests plant exactly that
and check the copy never lands where anyone else can write."""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from rlspec.rollout.vllm_backend.scratch import ScratchDir, process_tag

OTHER_UID = 4242  # some other user's uid
as_root = pytest.mark.skipif(os.getuid() != 0, reason="planting a directory owned by another user needs root")


def _private_all_the_way(path: Path, top: Path) -> bool:
    """Every directory from `path` up to and including `top` is ours with mode 0700."""
    for d in (path, *path.parents):
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            return False
        if d == top:
            return True
    return False


def test_a_fresh_root_and_every_directory_under_it_are_0700(tmp_path):
    root = tmp_path / "rlspec-0"
    d = ScratchDir.create("rlspec-vllm-", root=root)
    assert d.path.is_relative_to(root) and _private_all_the_way(d.path, root)
    d.close()


def test_our_own_root_left_open_to_others_is_tightened(tmp_path):
    root = tmp_path / "rlspec-0"
    root.mkdir()
    root.chmod(0o777)
    d = ScratchDir.create("rlspec-vllm-", root=root)
    assert d.path.is_relative_to(root) and _private_all_the_way(d.path, root)
    d.close()


def test_a_symlink_planted_at_the_root_is_not_followed(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o777)
    root = tmp_path / "rlspec-0"
    root.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        d = ScratchDir.create("rlspec-vllm-", root=root)
    assert list(elsewhere.iterdir()) == []  # nothing of ours went where the link pointed
    assert not d.path.is_relative_to(root) and _private_all_the_way(d.path, d.path.parent.parent)
    assert "a symlink" in caplog.text and str(root) in caplog.text
    d.close()


@as_root
def test_a_root_planted_by_another_user_is_refused(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    root = tmp_path / "rlspec-0"
    root.mkdir(mode=0o777)
    os.chown(root, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING):
        d = ScratchDir.create("rlspec-vllm-", root=root)
    assert list(root.iterdir()) == [] and not d.path.is_relative_to(root)
    assert _private_all_the_way(d.path, d.path.parent.parent)
    assert f"owned by uid {OTHER_UID}" in caplog.text
    d.close()


@as_root
def test_a_per_process_directory_planted_ahead_of_us_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    root = tmp_path / "rlspec-0"
    root.mkdir(mode=0o700)
    planted = root / process_tag()  # our pid and start time: what this process will ask for
    planted.mkdir(mode=0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)
    d = ScratchDir.create("rlspec-vllm-", root=root)
    assert list(planted.iterdir()) == [] and not d.path.is_relative_to(planted)
    assert _private_all_the_way(d.path, d.path.parent)
    d.close()
