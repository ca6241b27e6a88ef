"""rlspec.resume before any heavy import: output_dir must be a directory of the run's own, overwrite_output_dir
deletes only what rlspec wrote (its manifest), an explicit older checkpoint sets the newer ones aside, one
process per output_dir."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlspec.config import ConfigError, load_config
from rlspec.resume import prepare_output_dir, resolve_output_dir
from rlspec.trainers.run import checkpoint_dirs as dirs
from rlspec.trainers.run import run_files
from rlspec.trainers.run.run_files import LOCK

REPO = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return load_config("grpo_math.yaml", list(overrides))


def _users_project(root: Path) -> Path:
    """A directory holding a user's README.md and a checkpoint-notes/ folder."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("# my project\n")
    (root / "checkpoint-notes").mkdir()
    (root / "checkpoint-notes" / "ideas.txt").write_text("mine")
    return root


@pytest.mark.parametrize("value, why", [("", "empty"), ("/", "filesystem root"), ("~", "home directory"),
                                        ("..", "parent of the current directory")])
def test_output_dirs_that_are_not_the_runs_own_are_refused(value, why, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=why) as err:
        resolve_output_dir(value)
    assert "output_dir=outputs/run" in str(err.value)  # what to do
    assert resolve_output_dir(".") == tmp_path.resolve()  # the current directory itself is allowed


@pytest.mark.parametrize("output_dir", ["", "."])
def test_overwrite_in_the_current_directory_keeps_the_users_files(tmp_path, monkeypatch, output_dir):
    """Before: an empty output_dir meant the current directory, and overwrite deleted README.md and
    checkpoint-notes/ there. Now "" is refused and "." deletes only what rlspec recorded."""
    project = _users_project(tmp_path / "project")
    (project / "checkpoint-4").mkdir()  # a previous run's, recorded by it
    (project / "summary.json").write_text("{}")
    run_files.record(project, "checkpoint-4", "summary.json")
    monkeypatch.chdir(project)
    if not output_dir:
        with pytest.raises(ConfigError, match="empty"):
            resolve_output_dir(output_dir)
        return
    out = resolve_output_dir(output_dir)
    assert prepare_output_dir(_cfg(f"output_dir={output_dir}", "overwrite_output_dir=true"), out) is None
    assert (project / "README.md").read_text() == "# my project\n"
    assert (project / "checkpoint-notes" / "ideas.txt").read_text() == "mine"
    assert not (project / "checkpoint-4").exists() and not (project / "summary.json").exists()
    assert "checkpoint-4" not in run_files.recorded(project)


def test_the_cli_refuses_an_empty_output_dir_in_a_users_directory(tmp_path):
    """`python -m rlspec.train output_dir= overwrite_output_dir=true` run inside a user's directory: exit 2,
    before torch, nothing touched."""
    project = _users_project(tmp_path / "project")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "rlspec.train", "config=grpo_math.yaml", "output_dir=",
                           "overwrite_output_dir=true"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "output_dir" in proc.stderr and "empty" in proc.stderr
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "checkpoint-notes"]


def test_overwrite_refuses_run_named_entries_rlspec_did_not_write(tmp_path):
    out = _users_project(tmp_path / "out")
    (out / "checkpoint-7").mkdir()  # e.g. a plain HF run's: not in the manifest
    with pytest.raises(ConfigError, match="deletes only what rlspec wrote") as err:
        prepare_output_dir(_cfg(f"output_dir={out}", "overwrite_output_dir=true"), out)
    assert "checkpoint-7" in str(err.value) and (out / "checkpoint-7").is_dir()


def test_a_used_output_dir_without_resume_is_refused_naming_both_ways_on(tmp_path):
    out = _users_project(tmp_path / "out")
    with pytest.raises(ConfigError, match="resume=auto") as err:
        prepare_output_dir(_cfg(f"output_dir={out}"), out)
    assert "overwrite_output_dir=true" in str(err.value) and "is not empty" in str(err.value)
    # the manifest and the lock alone are not a run
    empty = tmp_path / "empty"
    run_files.record(empty, "summary.json")
    (empty / LOCK).write_text("{}")
    assert prepare_output_dir(_cfg(f"output_dir={empty}"), empty) is None


def test_an_explicit_older_checkpoint_sets_the_newer_ones_aside_before_the_model_loads(tmp_path, capsys):
    out = tmp_path / "out"
    for step in (100, 200, 300):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        dirs.write_marker(out / f"checkpoint-{step}", step, None)
    cfg = _cfg(f"output_dir={out}", f"resume={out / 'checkpoint-200'}")
    assert prepare_output_dir(cfg, out) == str(out / "checkpoint-200")
    assert "moved the newer checkpoint-300 aside" in capsys.readouterr().err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-100", "checkpoint-200"]
    assert prepare_output_dir(_cfg(f"output_dir={out}", "resume=auto"), out) == str(out / "checkpoint-200")


def test_the_cli_refuses_an_output_dir_another_live_process_holds(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "time": "then"}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "rlspec.train", "config=grpo_math.yaml", f"output_dir={out}",
                           "resume=auto"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"in use by pid {os.getppid()} on this host" in proc.stderr and "Traceback" not in proc.stderr
