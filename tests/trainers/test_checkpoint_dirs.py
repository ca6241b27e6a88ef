"""trainers.checkpoint_dirs: which checkpoints are complete, which one resume=auto picks, what rotation deletes."""
from __future__ import annotations

import os

from trainers import checkpoint_dirs as dirs


def _checkpoint(root, step: int, complete: bool = True, mtime: float | None = None):
    path = root / f"checkpoint-{step}"
    path.mkdir()
    (path / "model.safetensors").write_text("w")
    if complete:
        dirs.write_marker(path, step, "run1")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_resume_picks_the_newest_complete_checkpoint_and_reports_half_written_ones(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, complete=False)
    (tmp_path / "tmp-checkpoint-14").mkdir()
    (tmp_path / "checkpoint-junk").mkdir()
    path, skipped = dirs.find_resumable_checkpoint(tmp_path)
    assert path == tmp_path / "checkpoint-10"  # by step number: 10 > 2
    assert [(s.path.name, s.step) for s in skipped] == [("checkpoint-12", 12), ("tmp-checkpoint-14", 14)]
    assert "rlspec_complete.json" in skipped[0].reason and "temporary" in skipped[1].reason
    assert dirs.read_marker(path)["wandb_run_id"] == "run1"
    assert dirs.find_resumable_checkpoint(tmp_path / "missing") == (None, [])


def test_rotation_never_deletes_the_newest_complete_checkpoint(tmp_path):
    # the newest complete checkpoint has the oldest mtime (a clock step, a copied directory): still kept
    _checkpoint(tmp_path, 3, mtime=1e9)
    _checkpoint(tmp_path, 1, mtime=2e9)
    _checkpoint(tmp_path, 2, mtime=3e9)
    _checkpoint(tmp_path, 4, complete=False)  # half-written and newer: the run may be writing it
    (tmp_path / "tmp-checkpoint-0").mkdir()  # half-written and older: garbage
    deleted = dirs.rotate(tmp_path, limit=1)
    assert sorted(p.name for p in deleted) == ["checkpoint-1", "checkpoint-2", "tmp-checkpoint-0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    # limit 0 / None keep every complete checkpoint (the half-written 4 is now older than the newest: garbage);
    # `protect` keeps one beyond the limit
    _checkpoint(tmp_path, 5)
    assert [p.name for p in dirs.rotate(tmp_path, limit=None)] == ["checkpoint-4"]
    assert dirs.rotate(tmp_path, limit=0) == []
    dirs.rotate(tmp_path, limit=1, protect=[tmp_path / "checkpoint-3"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-5"]


def test_publish_replaces_a_same_step_checkpoint_whole(tmp_path):
    old = _checkpoint(tmp_path, 7)
    (old / "stale.bin").write_text("old")
    new = tmp_path / "tmp-checkpoint-7" / "checkpoint-7"
    new.mkdir(parents=True)
    dirs.write_marker(new, 7, None)
    dirs.publish(new, old)
    assert dirs.is_complete(old) and not (old / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-7", "tmp-checkpoint-7"]
