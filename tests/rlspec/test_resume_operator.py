"""An operator's day, through the CLI on the tiny float32 model (docs/resume.md): a run in a user's own directory
(`output_dir=.` with overwrite) keeps the user's README.md and checkpoint-notes/, and TRL's model card goes into
the checkpoints; a rollback to an older checkpoint followed by resume=auto (after a preemption) continues the
rolled-back branch, and rotation keeps the rollback point."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rlspec import resume_driver as driver

pytest.importorskip("trl")
pytest.importorskip("rlspec.rollout.engine")


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rollback_then_resume_auto_continues_the_rolled_back_branch_in_a_users_directory(tmp_path, monkeypatch,
                                                                                         capsys):
    from rlspec.train import main

    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    driver.register_reward(monkeypatch)
    args = driver.cli_args(driver.build_model(tmp_path / "tiny"))
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("# my project\n")
    (project / "checkpoint-notes").mkdir()
    (project / "checkpoint-notes" / "ideas.txt").write_text("mine")
    monkeypatch.chdir(project)

    # 1. three steps in the user's directory, starting over there: checkpoints 1, 2, 3 (the branch to abandon)
    assert main(args + ["output_dir=.", "overwrite_output_dir=true", "grpo.max_steps=3",
                        "grpo.save_total_limit=null"]) == 0
    assert (project / "README.md").read_text() == "# my project\n"  # TRL's card did not overwrite it
    assert (project / "checkpoint-notes" / "ideas.txt").read_text() == "mine"
    assert "TRL" in (project / "checkpoint-3" / "README.md").read_text()  # the card is in the checkpoint
    assert not list(project.glob("tmp-*")) and (project / "final" / "model.safetensors").is_file()
    diverged = _weights(project / "checkpoint-3")

    # 2. the operator rolls back to checkpoint-1 with another reward; saves step 2 with save_total_limit 2
    branch = args + ["output_dir=.", "rewards=[accuracy]", "grpo.save_total_limit=2"]
    capsys.readouterr()
    assert main(branch + [f"resume={project / 'checkpoint-1'}", "grpo.max_steps=2"]) == 0
    err = capsys.readouterr().err
    abandoned = [p for p in project.iterdir() if p.name.startswith("abandoned-")]
    assert len(abandoned) == 1 and abandoned[0].name.endswith("-from-1") and str(abandoned[0]) in err
    assert sorted(p.name for p in abandoned[0].iterdir()) == ["checkpoint-2", "checkpoint-3"]
    # the rollback point survives the rotation (before: deleted, with 3 of the abandoned branch kept)
    assert sorted(p.name for p in project.glob("checkpoint-[0-9]*")) == ["checkpoint-1", "checkpoint-2"]

    # 3. preempted, restarted with resume=auto: it continues the rolled-back branch's checkpoint-2, not the old 3
    capsys.readouterr()
    assert main(branch + ["resume=auto", "grpo.max_steps=3"]) == 0
    assert f"resuming from {project / 'checkpoint-2'}" in capsys.readouterr().out
    final = _weights(project / "final")
    assert not _same(final, diverged), "the run ended on the abandoned branch"
    marker = json.loads((project / "checkpoint-3" / "rlspec_complete.json").read_text())
    assert marker["step"] == 3 and _same(_weights(project / "checkpoint-3"), final)
    assert (project / "README.md").read_text() == "# my project\n"
    # nothing else of the run's lands beside the user's files (W&B's directory aside)
    assert sorted(p.name for p in project.iterdir() if p.name != "wandb") == sorted(
        ["README.md", "checkpoint-notes", abandoned[0].name, "checkpoint-2", "checkpoint-3", "final",
         "rlspec-manifest.txt", "summary.json"])
