"""Faults of long runs on clusters, injected for real through the CLI on the tiny float32 model (docs/resume.md,
"Faults and what happens"): a NaN written into the policy at a save step, a shard torn after its marker, a
user's drafter/ in output_dir, a symlinked manifest, another batch geometry on resume, SIGTERM to the process group
with a learned drafter's trainer in a child (the resumed run bit-identical to an uninterrupted one), the crash
path next to a checkpoint of its step, no flock."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rlspec import resume_driver as driver

pytest.importorskip("trl")
pytest.importorskip("rlspec.rollout.engine")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    driver.register_reward(monkeypatch)
    model_dir = driver.build_model(tmp_path / "tiny")
    return model_dir, driver.cli_args(model_dir) + ["grpo.save_total_limit=1"]


def _add_callback(monkeypatch, train, callback) -> None:
    build = train.build_trainer

    def build_with(cfg, out):
        trainer, summary_cb = build(cfg, out)
        trainer.add_callback(callback(trainer))
        return trainer, summary_cb

    monkeypatch.setattr(train, "build_trainer", build_with)


def _nan_at_end_of(step: int):
    from transformers import TrainerCallback

    class NanAtStepEnd(TrainerCallback):
        """One NaN weight at the end of step `step`, after the optimizer and before the Trainer's save."""

        def __init__(self, trainer):
            self.trainer = trainer

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                import torch

                with torch.no_grad():
                    next(self.trainer.model.parameters()).view(-1)[0] = float("nan")

    return NanAtStepEnd


def _finite(path: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(str(path / "model.safetensors")).values())


def test_a_nan_at_a_save_step_is_never_a_checkpoint_and_resume_continues_from_the_last_finite(tiny, tmp_path,
                                                                                               monkeypatch, capsys):
    """save_steps=2, save_total_limit=1, NaN at the end of step 4: checkpoint-4 is not written, checkpoint-2 stays
    (rotation never ran for a checkpoint that was not published), exit 1 naming the parameter and checkpoint-2;
    resume=auto continues from checkpoint-2 to the end."""
    import rlspec.train as train

    _, args = tiny
    out = tmp_path / "out"
    run = args + [f"output_dir={out}", "grpo.max_steps=4", "grpo.save_steps=2"]
    _add_callback(monkeypatch, train, _nan_at_end_of(4))
    assert train.main(run) == 1
    err = capsys.readouterr().err
    assert "weights are NaN/inf" in err and "checkpoint-4 was not written" in err and "checkpoint-2" in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"] and _finite(out / "checkpoint-2")
    assert not (out / "tmp-checkpoint-4").exists() and not (out / "crash").exists()
    assert json.loads((out / "summary.json").read_text())["status"] == "nonfinite"
    monkeypatch.undo()
    driver.register_reward(monkeypatch)
    assert train.main(run + ["resume=auto"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"] and _finite(out / "checkpoint-4")
    assert _finite(out / "final")


def test_a_shard_torn_after_its_marker_is_skipped_with_a_message(tiny, tmp_path, capsys):
    """checkpoint-3 marked complete, then its weights truncated (a write the disk lost in a power loss):
    resume=auto names it and why, continues from checkpoint-2 and rewrites checkpoint-3 whole."""
    import rlspec.train as train

    _, args = tiny
    out = tmp_path / "out"
    run = args[:-1] + ["grpo.save_total_limit=3", f"output_dir={out}", "grpo.save_steps=1"]
    assert train.main(run + ["grpo.max_steps=3"]) == 0
    shard = out / "checkpoint-3" / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    capsys.readouterr()
    assert train.main(run + ["grpo.max_steps=4", "resume=auto"]) == 0
    cap = capsys.readouterr()
    assert "skips the damaged" in cap.err and "checkpoint-3" in cap.err and "model.safetensors is" in cap.err
    assert f"resuming from {out / 'checkpoint-2'}" in cap.out
    assert _finite(out / "checkpoint-3") and json.loads((out / "summary.json").read_text())["status"] == "finished"


EAGLE = ["drafter.drafter=eagle3", "drafter.warm_start_s=0", "drafter.online_trainer=thread", "drafter.draft_vocab_size=32"]


def test_a_users_drafter_dir_survives_resume_auto_and_a_later_overwrite(tiny, tmp_path, capsys):
    """output_dir holds the user's drafter/ (and nothing else): resume=auto starts at step 0, does not claim it
    (not in the manifest, not exported over); overwrite_output_dir then deletes the run's files and not it."""
    import rlspec.train as train
    from rlspec.trainers.run import run_files

    _, args = tiny
    out = tmp_path / "out"
    (out / "drafter").mkdir(parents=True)
    (out / "drafter" / "notes.txt").write_text("mine")
    run = args + [f"output_dir={out}", "grpo.max_steps=1"] + EAGLE
    assert train.main(run + ["resume=auto"]) == 0
    assert "drafter" not in run_files.recorded(out) and "is not rlspec's" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "drafter").iterdir()) == ["notes.txt"]
    assert (out / "checkpoint-1" / "drafter" / "config.json").is_file()  # the drafter is still saved
    assert train.main(run + ["overwrite_output_dir=true"]) == 0
    assert (out / "drafter" / "notes.txt").read_text() == "mine"
    assert "summary.json" in run_files.recorded(out) and (out / "final").is_dir()


def test_a_symlinked_manifest_is_never_written_through(tmp_path):
    from rlspec.trainers.run import run_files

    target = tmp_path / "elsewhere.txt"
    target.write_text("mine\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / run_files.MANIFEST).symlink_to(target)
    with pytest.raises(OSError, match="symlink"):
        run_files.record(out, "checkpoint-1")
    assert target.read_text() == "mine\n"


def test_a_resume_with_another_batch_geometry_is_refused_naming_the_keys(tiny, tmp_path, capsys):
    import rlspec.train as train

    _, args = tiny
    out = tmp_path / "out"
    run = args + [f"output_dir={out}", "grpo.save_steps=1"]
    assert train.main(run + ["grpo.max_steps=1"]) == 0
    assert json.loads((out / "checkpoint-1" / "rlspec_complete.json").read_text())["geometry"][
        "per_device_train_batch_size"] == 8
    summary = (out / "summary.json").read_text()
    capsys.readouterr()
    assert train.main(run + ["grpo.max_steps=2", "resume=auto", "grpo.per_device_train_batch_size=4",
                             "grpo.extra.steps_per_generation=2"]) == 2
    err = capsys.readouterr().err
    assert "per_device_train_batch_size: 8 in the checkpoint, 4 now" in err and "Traceback" not in err
    assert (out / "summary.json").read_text() == summary and not (out / "crash").exists()


def test_sigterm_to_the_process_group_with_a_learned_drafter_in_a_child_resumes_bit_identical(tiny, tmp_path):
    """Slurm's scancel signals every process of the job: the run and its drafter trainer's child. The child
    ignores it, the run finishes step 2, checkpoints the child's training state with it and exits 143 with no
    process left behind; resume=auto restores that state and ends bit-identical to an uninterrupted run (the same
    rewards at every step, final weights equal).

    drafter=auto with selector=always: the learned (eagle3) drafter captures the rollouts' features into its child
    process, which trains whenever the engine idles and whose state the checkpoint carries, while every step
    drafts with the suffix drafter (auto's first). A learned drafter that drafts cannot
    end bit-identical, not even two uninterrupted runs: its child trains whenever the engine idles, so which
    weights draft which step depends on timing, and the drafts decide which random numbers sample which token
    (rollout/types.py, SamplingParams.seed)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch

    import rlspec.train as train

    model_dir, args = tiny
    out, straight = tmp_path / "out", tmp_path / "straight"
    drafter = ["drafter.drafter=auto", "drafter.warm_start_s=0", "drafter.online_trainer=process",
               "drafter.online_training=true", "drafter.draft_vocab_size=32", "drafter.selector=always",
               "grpo.save_steps=100", "grpo.max_steps=3"]
    env = {**os.environ, "RLSPEC_TEST_PAUSE_AT_STEP": "2", "PYTHONPATH": str(driver.REPO)}
    proc = subprocess.Popen([sys.executable, str(Path(driver.__file__)), str(model_dir), *drafter, f"output_dir={out}"],
                            cwd=driver.REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while not (out / "paused").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:] if proc.poll() else "slow"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as scancel does
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 143, err[-3000:]
    assert "gave no state" not in err
    deadline = time.time() + 30  # the child goes with the run, after its state was taken
    while _spawned_children(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not _spawned_children(proc.pid)
    state = torch.load(out / "checkpoint-2" / "rlspec_state.pt", weights_only=True)
    assert state["engine"]["speculation"]["trainer"] is not None  # the child's training state is in it
    (out / "paused").unlink()
    assert train.main(args + drafter + [f"output_dir={out}", "resume=auto"]) == 0
    assert train.main(args + drafter + [f"output_dir={straight}"]) == 0  # the uninterrupted run
    rewards = [[h["reward"] for h in json.loads((d / "summary.json").read_text())["history"] if "reward" in h]
               for d in (straight, out)]
    assert len(rewards[0]) == 3 and rewards[0] == rewards[1]
    a, b = (_weights(d / "final") for d in (straight, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], w) for k, w in _weights(model_dir).items() if k in a)  # the policy moved


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_the_crash_path_writes_no_second_copy_of_a_checkpointed_step(tmp_path, capsys):
    """An exception right after checkpoint-3 was written (a full disk at the next step): the checkpoint holds the
    policy, so no crash/ copy is written; with no checkpoint of that step, the copy is written; a crash/ of the
    user's is never written into."""
    from types import SimpleNamespace

    from rlspec.train import _save_crash
    from rlspec.trainers.run import checkpoint_dirs as dirs

    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "model.safetensors").write_text("w")
    dirs.write_marker(out / "checkpoint-3", 3, None, finite=True)
    saved = []
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=3))
    _save_crash(trainer, out, True, lambda t, path: saved.append(path))
    assert saved == [] and "is in" in capsys.readouterr().err
    trainer.state.global_step = 4
    _save_crash(trainer, out, True, lambda t, path: saved.append(path))
    assert saved == [out / "crash"]
    users = tmp_path / "users"
    (users / "crash").mkdir(parents=True)
    _save_crash(trainer, users, True, lambda t, path: saved.append(path))
    assert saved == [out / "crash"] and "not rlspec's" in capsys.readouterr().err


def _spawned_children(pgid: int) -> list[int]:
    """Live multiprocessing children (the drafter trainer) in process group `pgid`."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z" and b"spawn_main" in cmd:
            found.append(int(d.name))
    return found


def test_without_flock_the_cli_takes_a_stale_lock_and_refuses_a_fresh_one_with_exit_2(tmp_path, monkeypatch, capsys):
    """ENOLCK from flock (NFSv3 without lockd): never an OSError traceback. Another host's fresh lock is refused
    (exit 2, before torch); its stale one is taken over and the run gets as far as its config allows."""
    import errno
    import socket
    import time

    from rlspec.train import main
    from rlspec.trainers.run import run_lock
    from rlspec.trainers.run.run_files import LOCK

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", flock)
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"host": "other-node", "pid": 7, "heartbeat": time.time()}))
    assert main(["config=grpo_math.yaml", f"output_dir={out}", "resume=auto"]) == 2
    err = capsys.readouterr().err
    assert "locked by pid 7 on host other-node" in err and "Traceback" not in err
    assert socket.gethostname() != "other-node"
    (out / LOCK).write_text(json.dumps({"host": "other-node", "pid": 7, "heartbeat": time.time() - 3600}))
    with run_lock.hold(out):  # what the CLI takes first
        assert json.loads((out / LOCK).read_text())["host"] == socket.gethostname()
    assert "taking over" in capsys.readouterr().err
