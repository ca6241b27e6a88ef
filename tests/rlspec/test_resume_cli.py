"""Runs that survive, through the CLI on a tiny float32 model on CPU (docs/resume.md): a run killed with SIGKILL and
continued with resume=auto ends where an uninterrupted run ends; half-written checkpoints are skipped and
reported; SIGTERM/SIGINT stop with a complete checkpoint; a used output_dir is refused; an over-long prompt is
refused before step 1."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rlspec import resume_driver as driver

pytest.importorskip("trl")
pytest.importorskip("rlspec.rollout.engine")

REPO = driver.REPO


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """(model dir, CLI args) of the tiny run, W&B offline under each output_dir."""
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    driver.register_reward(monkeypatch)
    model_dir = driver.build_model(tmp_path / "tiny")
    return model_dir, driver.cli_args(model_dir)


def _history(out: Path) -> dict[int, float]:
    return {h["step"]: h["reward"] for h in json.loads((out / "summary.json").read_text())["history"] if "reward" in h}


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_identical(a: dict, b: dict, what: str) -> None:
    """Bit-identical tensors (the README's claim for a continued run: largest weight difference 0)."""
    import torch

    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {len(differ)} tensor(s) differ, e.g. {differ[0]} (max abs diff {_max_diff(a, b):.3e})"


def _kill_when_hanging(proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not (out / "hanging").exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"the run never reached the kill point (rc {proc.returncode}): "
                                 f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_kill9_then_resume_auto_matches_the_uninterrupted_run(tiny, tmp_path, capsys):
    """SIGKILL during step 3 (checkpoint-2 complete), plus a half-written checkpoint-3 and tmp-checkpoint-4
    left behind: resume=auto skips and reports both, continues from checkpoint-2, logs the same rewards for
    steps 3-4 and ends with the same weights as a straight 4-step run; W&B appends to the same run id."""
    from rlspec.train import main

    model_dir, args = tiny
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args + ["grpo.max_steps=4", f"output_dir={straight}"]) == 0

    env = {**os.environ, "RLSPEC_TEST_HANG_AT_STEP": "3", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(Path(driver.__file__)), str(model_dir), "grpo.max_steps=4",
                             f"output_dir={resumed}"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _kill_when_hanging(proc, resumed)
    assert proc.returncode == -signal.SIGKILL
    assert (resumed / "checkpoint-2" / "rlspec_complete.json").is_file() and not (resumed / "checkpoint-3").exists()
    # what a kill during a save leaves: a checkpoint-3 without its marker, a temporary directory
    shutil.copytree(resumed / "checkpoint-2", resumed / "checkpoint-3", ignore=shutil.ignore_patterns("rlspec_*"))
    (resumed / "tmp-checkpoint-4").mkdir()
    (resumed / "hanging").unlink()
    capsys.readouterr()

    assert main(args + ["grpo.max_steps=4", f"output_dir={resumed}", "resume=auto"]) == 0
    err = capsys.readouterr().err
    assert "skips the half-written" in err and "checkpoint-3" in err and "tmp-checkpoint-4" in err
    a, b = _history(straight), _history(resumed)
    assert sorted(b) == [1, 2, 3, 4] and {s: a[s] for s in (3, 4)} == {s: b[s] for s in (3, 4)}
    assert len(set(a.values())) > 1, "the rewards must vary for the comparison to mean anything"
    _assert_identical(_weights(straight / "final"), _weights(resumed / "final"), "final weights")
    # the policy moved: a resume that restored nothing would not match
    assert _max_diff(_weights(straight / "checkpoint-4"), _weights(straight / "checkpoint-3")) > 1e-4
    # rotation (save_total_limit 2) kept the two newest complete checkpoints; nothing half-written is left
    assert sorted(p.name for p in resumed.iterdir() if "checkpoint" in p.name) == ["checkpoint-3", "checkpoint-4"]
    assert all((resumed / f"checkpoint-{s}" / "rlspec_complete.json").is_file() for s in (3, 4))
    ids = {p.name.rsplit("-", 1)[-1] for p in (resumed / "wandb" / "wandb").glob("offline-run-*")}
    assert len(ids) == 1, f"the resumed run must log to the first run's W&B id, got {ids}"
    marker = json.loads((resumed / "checkpoint-4" / "rlspec_complete.json").read_text())
    assert marker["step"] == 4 and marker["wandb_run_id"] in ids


def test_sigterm_writes_a_checkpoint_and_the_drafter_then_exits_143(tiny, tmp_path, monkeypatch):
    """SIGTERM arriving during step 2 (save_steps far away): step 2 finishes, checkpoint-2 is written complete
    with the learned drafter, the drafter is exported, the exit code is 143; resume=auto then finishes."""
    import rlspec.train as train

    _, args = tiny
    out = tmp_path / "out"
    _signal_at_step(monkeypatch, train, 2, [signal.SIGTERM])
    run = args + [f"output_dir={out}", "grpo.max_steps=3", "grpo.save_steps=100", "drafter.drafter=eagle3",
                  "drafter.warm_start_s=0", "drafter.online_trainer=thread", "drafter.draft_vocab_size=32"]
    assert train.main(run) == 143
    assert (out / "checkpoint-2" / "rlspec_complete.json").is_file() and not (out / "checkpoint-3").exists()
    assert (out / "checkpoint-2" / "drafter" / "config.json").is_file()
    assert (out / "drafter" / "config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["error"] and summary["final_model"] is None
    monkeypatch.undo()  # no signal this time
    driver.register_reward(monkeypatch)
    assert train.main(run + ["resume=auto"]) == 0
    assert sorted(_history(out)) == [1, 2, 3] and (out / "final" / "model.safetensors").is_file()


def test_a_second_sigint_aborts_at_once(tiny, tmp_path, monkeypatch):
    import rlspec.train as train

    _, args = tiny
    # a process started in the background by a non-interactive shell inherits SIGINT ignored: the run must
    # abort there too (trainers/run/interrupts.py), and put back whatever disposition it found
    before = signal.getsignal(signal.SIGINT)
    _signal_at_step(monkeypatch, train, 1, [signal.SIGINT, signal.SIGINT])
    with pytest.raises(KeyboardInterrupt):
        train.main(args + [f"output_dir={tmp_path / 'out'}", "grpo.max_steps=3", "grpo.save_steps=100"])
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert signal.getsignal(signal.SIGINT) is before  # handlers are put back


def _signal_at_step(monkeypatch, train, step: int, signals: list) -> None:
    """Deliver `signals` to this process when step `step` begins (a real signal, the real handler)."""
    from transformers import TrainerCallback

    class SendSignal(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:
                for s in signals:
                    os.kill(os.getpid(), s)

    build = train.build_trainer

    def build_and_signal(cfg, out):
        trainer, summary_cb = build(cfg, out)
        trainer.add_callback(SendSignal())
        return trainer, summary_cb

    monkeypatch.setattr(train, "build_trainer", build_and_signal)


def test_a_used_output_dir_is_refused_before_torch_then_overwritten_on_request(tiny, tmp_path):
    model_dir, args = tiny
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    from rlspec.trainers.run import run_files

    run_files.record(out, "checkpoint-3", "summary.json")  # a previous run's (overwrite deletes only those)
    code = (f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom rlspec.train import main\n"
            "from tests.rlspec.resume_driver import register_reward\nregister_reward()\n"
            f"rc = main({args + [f'output_dir={out}']!r})\n"
            "assert 'torch' not in sys.modules, 'the refusal must come before heavy imports'\nsys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "resume=auto" in proc.stderr and "overwrite_output_dir=true" in proc.stderr and "checkpoint-3" in proc.stderr

    from rlspec.train import main

    assert main(args + [f"output_dir={out}", "grpo.max_steps=1", "overwrite_output_dir=true"]) == 0
    assert not (out / "checkpoint-3").exists() and (out / "checkpoint-1" / "rlspec_complete.json").is_file()
    assert (out / "notes.txt").read_text() == "mine"  # not a run output: left alone
    assert main(args + [f"output_dir={out}", "resume=auto", "overwrite_output_dir=true"]) == 2


def test_resume_from_an_explicit_half_written_checkpoint_is_refused(tiny, tmp_path, capsys):
    from rlspec.train import main

    _, args = tiny
    half = tmp_path / "out" / "checkpoint-5"
    half.mkdir(parents=True)
    assert main(args + [f"output_dir={tmp_path / 'out'}", f"resume={half}"]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err


def test_ppo_resume_matches_the_uninterrupted_run(tmp_path, monkeypatch):
    """PPO (value head, suffix speculation, minibatch shuffling): resuming from checkpoint-1 of a 3-step run
    logs the same rewards and ends with the same policy and value head."""
    from rlspec.train import main

    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    driver.register_reward(monkeypatch)
    # selector=always: the default selector picks arms from measured step times, so even two uninterrupted
    # runs differ with speculation on (rollout/types.py, SamplingParams.seed); `always` keeps the suffix arm
    args = driver.cli_args(driver.build_model(tmp_path / "tiny"), "ppo") + [
        "ppo.max_steps=3", "ppo.num_mini_batches=2", "ppo.per_device_train_batch_size=4", "drafter.selector=always"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args + [f"output_dir={straight}", "ppo.save_total_limit=3"]) == 0
    shutil.copytree(straight / "checkpoint-1", resumed / "checkpoint-1")
    assert main(args + [f"output_dir={resumed}", "resume=auto"]) == 0
    a, b = _history(straight), _history(resumed)
    assert a[2] == b[2] and a[3] == b[3]
    _assert_identical(_weights(straight / "final"), _weights(resumed / "final"), "final policy")
    from safetensors.torch import load_file

    va, vb = (load_file(str(d / "final" / "value_model.safetensors")) for d in (straight, resumed))
    _assert_identical(va, vb, "final value model")
    assert _max_diff(_weights(straight / "checkpoint-3"), _weights(straight / "checkpoint-1")) > 1e-4


@pytest.mark.parametrize("resume_step", [2, 3])
def test_resume_across_epochs_draws_the_same_data_order(tiny, tmp_path, resume_step):
    """4 prompts = 2 steps per epoch, 5 steps: the sampler draws a new permutation each epoch. Resuming at
    an epoch's end (checkpoint-2) or inside one (checkpoint-3) continues with the uninterrupted run's order."""
    from rlspec.train import main

    _, args = tiny
    args = args + ["grpo.max_steps=5", "data.num_examples=4", "grpo.save_total_limit=null"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args + [f"output_dir={straight}"]) == 0
    shutil.copytree(straight / f"checkpoint-{resume_step}", resumed / f"checkpoint-{resume_step}")
    assert main(args + [f"output_dir={resumed}", "resume=auto"]) == 0
    a, b = _history(straight), _history(resumed)
    assert all(a[s] == b[s] for s in range(resume_step + 1, 6))
    _assert_identical(_weights(straight / "final"), _weights(resumed / "final"), "final weights")
    # the policy moved after the resume point: a resume that restored nothing would not match
    assert _max_diff(_weights(straight / "final"), _weights(straight / f"checkpoint-{resume_step}")) > 1e-4


def test_an_over_long_prompt_is_refused_before_step_1_or_dropped_on_request(tiny, tmp_path, capsys):
    """A local dataset whose row 5 is longer than the 256-token context: exit 2 naming the row, before any step
    or checkpoint; data.drop_long_prompts=true trains without it and says so."""
    from rlspec.train import main

    _, args = tiny
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(8)]
    rows[5]["question"] = "What is " + " + ".join(["1"] * 150) + "?"
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = args + [f"data.name={data}", "data.num_examples=null", "grpo.max_steps=1"]
    out = tmp_path / "out"
    assert main(run + [f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "1 of 8 prompt(s) too long: prompt " in err and "context is 256 tokens" in err
    assert "data.drop_long_prompts" in err and "Traceback" not in err
    assert not list(out.glob("checkpoint-*")) and not (out / "summary.json").exists()
    assert main(run + [f"output_dir={tmp_path / 'dropped'}", "data.drop_long_prompts=true"]) == 0
    assert sorted(_history(tmp_path / "dropped")) == [1]
