"""Which directories compiled code may be loaded from (rollout/runtime/model/kernels/trust.py): only those no
other user can change, all the way up to /."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlspec.rollout.runtime.model.kernels.trust import private_dir, untrusted_reason

as_root = pytest.mark.skipif(os.getuid() != 0, reason="a directory owned by another user needs root to make")


def _dir(path: Path, mode: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


def test_a_private_directory_and_a_sticky_parent_are_trusted(tmp_path):
    assert untrusted_reason(_dir(tmp_path / "mine", 0o700)) is None
    assert untrusted_reason(_dir(tmp_path / "public", 0o755)) is None  # readable is fine: nobody can change it
    sticky = _dir(tmp_path / "tmp", 0o1777)  # as /tmp: others add entries, but cannot rename ours
    assert untrusted_reason(_dir(sticky / "cache", 0o700) / "kernels" / "not-yet") is None


@pytest.mark.parametrize("mode,who", [(0o770, "group"), (0o707, "others"), (0o777, "group and others")])
def test_a_directory_others_can_write_anywhere_above_is_not(tmp_path, mode, who):
    shared = _dir(tmp_path / "shared", mode)
    deep = _dir(shared / "cache" / "kernels", 0o700)  # private itself, but its parent can be renamed away
    reason = untrusted_reason(deep / "lib.so")
    assert reason is not None and f"{shared} is writable by {who}" in reason and "chmod go-w" in reason


def test_a_symlink_is_judged_by_where_it_leads(tmp_path):
    link = tmp_path / "cache"
    link.symlink_to(_dir(tmp_path / "shared", 0o777))
    assert "writable by group and others" in untrusted_reason(link / "kernels")


@as_root
def test_a_directory_owned_by_another_user_is_not(tmp_path):
    theirs = _dir(tmp_path / "theirs", 0o755)
    os.chown(theirs, 4242, 4242)
    assert "owned by uid 4242" in untrusted_reason(theirs / "kernels")


def test_private_dir_makes_missing_directories_0700_and_swaps_an_open_one_for_a_fresh_private_one(tmp_path):
    made = private_dir(tmp_path / "a" / "b", "tests")
    assert made == tmp_path / "a" / "b"
    assert all((p.stat().st_mode & 0o777) == 0o700 for p in (made, made.parent))
    shared = _dir(tmp_path / "shared", 0o777)
    with pytest.warns(UserWarning, match=f"not using {shared / 'c'} for tests: {shared} is writable"):
        other = private_dir(shared / "c", "tests")
    assert not other.is_relative_to(shared) and (other.stat().st_mode & 0o777) == 0o700
    assert untrusted_reason(other) is None


def test_inductor_s_compile_cache_is_not_kept_in_a_cache_others_can_write(tmp_path, monkeypatch):
    from rlspec.rollout.runtime.compiled import inductor_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert inductor_cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine" / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    shared = _dir(tmp_path / "shared", 0o777)
    with pytest.warns(UserWarning, match="inductor's compiled graphs"):
        path = inductor_cache_dir(str(shared))
    assert not Path(path).is_relative_to(shared) and os.environ["TORCHINDUCTOR_CACHE_DIR"] == path


def test_a_symlink_in_a_directory_others_can_write_is_not_trusted_and_the_resolved_path_is_returned(tmp_path):
    """A link to a private cache, kept in a world-writable (not sticky) directory: anyone can swap the link, so
    the link's own directory counts; a trusted path comes back resolved, so what was checked is what is used."""
    mine = _dir(tmp_path / "mine", 0o700)
    shared = _dir(tmp_path / "shared", 0o777)
    (shared / "cache").symlink_to(mine)
    reason = untrusted_reason(shared / "cache" / "kernels")
    assert reason is not None and f"{shared} is writable" in reason
    (tmp_path / "link").symlink_to(mine)
    assert private_dir(tmp_path / "link" / "k", "tests") == mine / "k"
