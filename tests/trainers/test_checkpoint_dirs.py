"""trainers.checkpoint_dirs: which checkpoints are complete, which one resume=auto picks, what rotation deletes,
what a crash inside publish() leaves and how scan repairs it, what a rollback sets aside."""
from __future__ import annotations

import os

import pytest

from rlspec.trainers.run import checkpoint_dirs as dirs
from rlspec.trainers.run import run_files


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
    run_files.record(tmp_path, "checkpoint-4", "tmp-checkpoint-0")  # the run recorded both before writing them
    deleted = dirs.rotate(tmp_path, limit=1)
    assert sorted(p.name for p in deleted) == ["checkpoint-1", "checkpoint-2", "tmp-checkpoint-0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4", run_files.MANIFEST]
    # limit 0 / None keep every complete checkpoint (the half-written 4 is now older than the newest: garbage);
    # `protect` keeps one beyond the limit
    _checkpoint(tmp_path, 5)
    assert [p.name for p in dirs.rotate(tmp_path, limit=None)] == ["checkpoint-4"]
    assert dirs.rotate(tmp_path, limit=0) == []
    dirs.rotate(tmp_path, limit=1, protect=[tmp_path / "checkpoint-3"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-5", run_files.MANIFEST]


def test_rotation_never_deletes_a_half_written_looking_directory_rlspec_did_not_write(tmp_path):
    """A plain HF checkpoint-2 of the user's (no marker, not in the manifest) beside the run's checkpoints."""
    user = _checkpoint(tmp_path, 2, complete=False)
    _checkpoint(tmp_path, 5)
    assert dirs.rotate(tmp_path, limit=1) == []
    assert (user / "model.safetensors").is_file()


def test_publish_replaces_a_same_step_checkpoint_whole(tmp_path):
    old = _checkpoint(tmp_path, 7)
    (old / "stale.bin").write_text("old")
    new = tmp_path / "tmp-checkpoint-7" / "checkpoint-7"
    new.mkdir(parents=True)
    dirs.write_marker(new, 7, None)
    dirs.publish(new, old)
    assert dirs.is_complete(old) and not (old / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-7", run_files.MANIFEST, "tmp-checkpoint-7"]


def _crash_between_renames(root, step: int):
    """What publish() leaves when the process dies between its two renames while re-saving a step: the old copy
    as tmp-old-checkpoint-N, the new complete copy still staged, no checkpoint-N."""
    old = _checkpoint(root, step)
    (old / "which").write_text("old")
    staged = root / f"tmp-checkpoint-{step}" / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    (staged / "which").write_text("new")
    dirs.write_marker(staged, step, None)
    os.replace(old, root / f"tmp-old-checkpoint-{step}")
    return old


@pytest.mark.parametrize("new_copy_complete", [True, False])
def test_a_crash_between_the_renames_of_publish_is_repaired_by_the_scan(tmp_path, new_copy_complete):
    """Before: no checkpoint-3 at all, resume=auto fell back to checkpoint-2 and a rotation deleted the complete
    temporary copy. Now the scan finishes the rename (new copy complete) or puts the old copy back."""
    _checkpoint(tmp_path, 2)
    final = _crash_between_renames(tmp_path, 3)
    if not new_copy_complete:
        (tmp_path / "tmp-checkpoint-3" / "checkpoint-3" / dirs.MARKER).unlink()
    path, skipped = dirs.find_resumable_checkpoint(tmp_path)
    assert path == final and dirs.is_complete(final)
    assert (final / "which").read_text() == ("new" if new_copy_complete else "old")
    assert not (tmp_path / "tmp-old-checkpoint-3").exists()
    assert (tmp_path / "tmp-checkpoint-3").exists() != new_copy_complete  # an incomplete new copy stays, reported
    assert [s.path.name for s in skipped] == ([] if new_copy_complete else ["tmp-checkpoint-3"])


def test_the_scan_removes_the_old_copy_left_after_the_last_rename_and_publishes_a_marked_staging(tmp_path):
    done = _checkpoint(tmp_path, 4)
    (tmp_path / "tmp-old-checkpoint-4").mkdir()  # killed after the second rename, before the old copy went
    staged = tmp_path / "tmp-checkpoint-6" / "checkpoint-6"  # killed between the marker and the rename
    staged.mkdir(parents=True)
    dirs.write_marker(staged, 6, None)
    complete, skipped = dirs.scan(tmp_path)
    assert [p.name for _, p in complete] == ["checkpoint-4", "checkpoint-6"] and skipped == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert dirs.is_complete(done)


def test_set_aside_newer_moves_the_abandoned_branch_out_of_sight(tmp_path):
    """Checkpoints 100, 200, 300 (diverged), a half-written 350: resuming from 200 moves 300 and 350 into
    abandoned-<date>-from-200/; resume=auto then picks 200, and rotation (limit 2) after 250 keeps 200."""
    for step in (100, 200, 300):
        _checkpoint(tmp_path, step)
    (tmp_path / "tmp-checkpoint-350").mkdir()
    folder, moved = dirs.set_aside_newer(tmp_path, 200)
    assert folder.name.startswith("abandoned-") and folder.name.endswith("-from-200")
    assert sorted(p.name for p in moved) == ["checkpoint-300", "tmp-checkpoint-350"]
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-300", "tmp-checkpoint-350"]
    assert folder.name in run_files.recorded(tmp_path)  # overwrite_output_dir may delete it later
    assert dirs.find_resumable_checkpoint(tmp_path) == (tmp_path / "checkpoint-200", [])
    _checkpoint(tmp_path, 250)
    dirs.rotate(tmp_path, limit=2, protect=[tmp_path / "checkpoint-250"])
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-200", "checkpoint-250"]
    assert dirs.is_complete(folder / "checkpoint-300")  # rotation never looks into the folder
    assert dirs.set_aside_newer(tmp_path, 250) == (None, [])
    assert dirs.checkpoint_step(folder / "checkpoint-300") == 300
