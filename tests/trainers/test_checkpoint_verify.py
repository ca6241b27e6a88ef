"""trainers.checkpoint_verify and trainers.resume_point: a checkpoint without rlspec's marker (an older rlspec, a
plain HF/TRL checkpoint) resumes when named and its files verify; one cut short is refused, saying what is wrong."""
from __future__ import annotations

import json
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from rlspec.trainers.run import checkpoint_dirs as dirs
from rlspec.trainers.run.checkpoint_verify import checkpoint_problems
from rlspec.trainers.run.resume_point import explicit_checkpoint, roll_back


def _plain_checkpoint(root, step: int):
    """The files the HF Trainer writes (no rlspec_complete.json)."""
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path / "model.safetensors"))
    torch.save({"state": {}}, path / "optimizer.pt")
    torch.save({"last_epoch": step}, path / "scheduler.pt")
    torch.save({"python": 1}, path / "rng_state.pth")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return path


def test_a_checkpoint_without_the_marker_resumes_when_its_files_verify(tmp_path, capsys):
    path = _plain_checkpoint(tmp_path, 20)
    assert checkpoint_problems(path) == []
    assert explicit_checkpoint(path) == path.resolve()  # before: refused for the missing marker alone
    assert "its files verify" in capsys.readouterr().err
    assert dirs.checkpoint_step(path) == 20


@pytest.mark.parametrize("damage, expected", [
    ("truncate_weights", "model.safetensors is cut short"),
    ("truncate_optimizer", "optimizer.pt is not a whole torch file"),
    ("no_optimizer", "no optimizer.pt"),
    ("no_state", "no trainer_state.json"),
    ("bad_state", "trainer_state.json is not valid JSON"),
    ("no_weights", "no model weights"),
])
def test_a_checkpoint_cut_short_is_refused_with_what_is_wrong(tmp_path, damage, expected):
    _plain_checkpoint(tmp_path, 10)
    dirs.write_marker(tmp_path / "checkpoint-10", 10, None)  # a complete one to point to
    path = _plain_checkpoint(tmp_path, 20)
    if damage.startswith("truncate"):
        f = path / ("model.safetensors" if damage == "truncate_weights" else "optimizer.pt")
        f.write_bytes(f.read_bytes()[:-40])
    elif damage == "bad_state":
        (path / "trainer_state.json").write_text('{"global_step": 2')
    else:
        name = {"no_optimizer": "optimizer.pt", "no_state": "trainer_state.json", "no_weights": "model.safetensors"}
        (path / name[damage]).unlink()
    assert any(expected in p for p in checkpoint_problems(path))
    with pytest.raises(ValueError, match="not a complete checkpoint") as err:
        explicit_checkpoint(path)
    assert expected in str(err.value) and f"resume={tmp_path / 'checkpoint-10'}" in str(err.value)


def test_sharded_weights_need_every_shard_the_index_names(tmp_path):
    path = _plain_checkpoint(tmp_path, 5)
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_problems(path) == ["the weight shard model-00002-of-00002.safetensors that "
                                         "model.safetensors.index.json names is missing"]
    assert zipfile.is_zipfile(path / "optimizer.pt")  # torch.save's format, which the check relies on


def test_roll_back_names_where_the_newer_checkpoints_went(tmp_path, capsys):
    for step in (1, 2, 3):
        _plain_checkpoint(tmp_path, step)
        dirs.write_marker(tmp_path / f"checkpoint-{step}", step, None)
    folder = roll_back(tmp_path, tmp_path / "checkpoint-1")
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert str(folder) in capsys.readouterr().err
    assert roll_back(tmp_path, tmp_path / "checkpoint-1") is None
