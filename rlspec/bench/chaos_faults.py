"""The faults `python -m rlspec.bench chaos` injects, one function each: (work dir, straight run) -> its row."""
from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

from rlspec.bench.chaos_run import NAN_PARAM, STEPS, Run, compare, complete_checkpoints, history, resume, summary_of

def fault_kill9_mid_step(work: Path, straight: Path) -> dict:
    out = work / "kill9_mid_step"
    run = Run(out)
    run.wait_for(out.parent / f"{out.name}.step-3")
    time.sleep(1.0)  # inside step 3's rollout
    run.proc.send_signal(signal.SIGKILL)
    rc = run.wait()
    kept = complete_checkpoints(out)
    return {"fault": "kill -9", "injected": "during step 3 (checkpoint-2 complete)", "exit_code": rc,
            "user_saw": "the process died (no message)", "checkpoints_after_fault": kept,
            "lost": "step 3's partial work (rerun from checkpoint-2)", **resume(out, straight, 2)}


def fault_kill9_mid_save(work: Path, straight: Path) -> dict:
    out = work / "kill9_mid_save"
    run = Run(out)
    run.wait_for(out / f"tmp-checkpoint-{STEPS}")  # the Trainer has started writing the last checkpoint
    run.proc.send_signal(signal.SIGKILL)
    rc = run.wait()
    half = sorted(p.name for p in out.iterdir() if p.name.startswith(("tmp-checkpoint", "checkpoint"))
                  and p.name not in complete_checkpoints(out))
    return {"fault": "kill -9", "injected": f"while checkpoint-{STEPS} was being written", "exit_code": rc,
            "user_saw": "the process died (no message)", "half_written_left": half,
            "checkpoints_after_fault": complete_checkpoints(out),
            "lost": f"steps 3-{STEPS} (rerun from checkpoint-2); the half-written checkpoint is skipped",
            **resume(out, straight, 2)}


def _signal_fault(work: Path, straight: Path, sig: signal.Signals) -> dict:
    out = work / f"{sig.name.lower()}"
    run = Run(out, ["grpo.save_steps=100"])  # no routine checkpoint: the signal's only
    run.wait_for(out.parent / f"{out.name}.step-2")
    time.sleep(1.0)
    run.proc.send_signal(sig)
    rc = run.wait()
    summary = summary_of(out) or {}
    return {"fault": sig.name, "injected": "during step 2 (no checkpoint yet)", "exit_code": rc,
            "user_saw": run.said(), "status": summary.get("status"), "checkpoints_after_fault": complete_checkpoints(out),
            "lost": "nothing" if "checkpoint-2" in complete_checkpoints(out) else "steps since the last checkpoint",
            **resume(out, straight, 2, ["grpo.save_steps=100"])}


def fault_sigterm(work: Path, straight: Path) -> dict:
    return _signal_fault(work, straight, signal.SIGTERM)


def fault_sigint(work: Path, straight: Path) -> dict:
    return _signal_fault(work, straight, signal.SIGINT)


def fault_rerun_without_resume(work: Path, straight: Path) -> dict:
    out = work / "rerun"
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("wandb"))
    before = complete_checkpoints(out)
    run = Run(out)
    rc = run.wait()
    return {"fault": "the same command again, without resume", "injected": "after a finished run", "exit_code": rc,
            "user_saw": run.said(), "checkpoints_after_fault": complete_checkpoints(out),
            "lost": "nothing" if complete_checkpoints(out) == before else "checkpoints deleted",
            "resumed_equals_straight": None}


def fault_nan_stop(work: Path, straight: Path) -> dict:
    out = work / "nan_stop"
    run = Run(out, env={"CHAOS_NAN_AT_STEP": "3"})
    rc = run.wait()
    return {"fault": f"NaN in {NAN_PARAM}", "injected": "at the start of step 3 (on_nonfinite=stop)",
            "exit_code": rc, "user_saw": run.said(), "checkpoints_after_fault": complete_checkpoints(out),
            "lost": "nothing before step 3", **resume(out, straight, 2)}


def fault_nan_skip_batch(work: Path, straight: Path) -> dict:
    out = work / "nan_skip"
    run = Run(out, ["on_nonfinite=skip_batch"], env={"CHAOS_NAN_AT_STEP": "3", "CHAOS_NAN_HEAL": "1"})
    rc = run.wait()
    summary = summary_of(out) or {}
    skipped = [h.get("rollout/nonfinite_skipped") for h in summary.get("history", []) if "rollout/nonfinite_skipped" in h]
    return {"fault": f"NaN in {NAN_PARAM}, gone after one step", "injected": "step 3 (on_nonfinite=skip_batch)",
            "exit_code": rc, "user_saw": run.said(), "status": summary.get("status"), "skipped_logged": skipped,
            "lost": "step 3's batch (skipped, no update)", "resumed_equals_straight": None}


def _long_prompt_data(work: Path) -> Path:
    """A local dataset of 16 short questions and one far longer than the 256-token context."""
    data = work / "long_prompt_data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(16)]
    rows.insert(7, {"question": "Add these numbers: " + " + ".join(["1"] * 200) + ".", "answer": "200"})
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def fault_long_prompt(work: Path, straight: Path) -> dict:
    data = _long_prompt_data(work)
    out = work / "long_prompt"
    run = Run(out, [f"data.name={data}", "data.num_examples=null", "grpo.max_steps=1"])
    rc = run.wait()
    started = (out.parent / f"{out.name}.step-1").exists()
    dropped = Run(work / "long_prompt_drop", [f"data.name={data}", "data.num_examples=null", "grpo.max_steps=1",
                                               "data.drop_long_prompts=true"])
    drop_rc = dropped.wait()
    return {"fault": "one prompt longer than the context", "injected": "row of a 17-row dataset",
            "exit_code": rc, "user_saw": run.said(), "reached_step_1": started,
            "with_drop_long_prompts": {"exit_code": drop_rc, "said": dropped.said()},
            "lost": "nothing (refused before step 1)", "resumed_equals_straight": None}


def fault_unsupported_model(work: Path, straight: Path) -> dict:
    from rlspec.rollout.runtime.model.fetch import fetch_model

    model = work / "longrope_model"
    if not model.is_dir():
        shutil.copytree(fetch_model("smollm2-135m-instruct"), model)
        cfg = json.loads((model / "config.json").read_text())
        cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
        (model / "config.json").write_text(json.dumps(cfg))
    out = work / "unsupported"
    run = Run(out, [f"model={model}"])
    rc = run.wait()
    reached = bool(history(out))  # the engine refuses the model; the run either stops or generates through TRL
    return {"fault": "a model feature the runtime does not compute", "injected": "rope_scaling dynamic in config.json",
            "exit_code": rc, "user_saw": run.said(), "reached_step_1": reached,
            "lost": "nothing (TRL's own generation, no speculation)" if reached else "nothing (refused at load)",
            "resumed_equals_straight": None}


def fault_torn_checkpoint(work: Path, straight: Path) -> dict:
    """A power loss that kept checkpoint-4's marker but not all of its weights: the straight run's directory with
    checkpoint-4's shard cut in half."""
    out = work / "torn_checkpoint"
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("wandb", "final"))
    shard = out / f"checkpoint-{STEPS}" / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    row = resume(out, straight, 2)
    return {"fault": "a torn checkpoint (power loss after the marker)", "injected": f"checkpoint-{STEPS}'s weights "
            "truncated to half", "exit_code": None, "user_saw": row["resume_said"],
            "lost": f"steps 3-{STEPS} (rerun from checkpoint-2); the torn checkpoint is named and rewritten", **row}


def fault_stale_lock_other_host(work: Path, straight: Path) -> dict:
    """A requeue on another node after the first node died: its lock, renewed an hour ago, is still there."""
    out = work / "stale_lock"
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("wandb", "final", f"checkpoint-{STEPS}"))
    (out / "rlspec.lock").write_text(json.dumps({"host": "another-node", "pid": 4242, "time": "then",
                                                 "heartbeat": time.time() - 3600}))
    row = resume(out, straight, 2)
    return {"fault": "a lock left by another host (a requeue on another node)", "injected": "rlspec.lock of host "
            "another-node, heartbeat an hour old", "exit_code": None, "user_saw": row["resume_said"],
            "lost": "nothing (taken over with a line saying so)", **row}


def _from_checkpoint_2(work: Path, name: str, straight: Path) -> Path:
    """A run stopped after checkpoint-2: the straight run's directory without checkpoint-4 and the final model."""
    out = work / name
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("wandb", "final", f"checkpoint-{STEPS}"))
    return out


def fault_nan_at_save_step(work: Path, straight: Path) -> dict:
    """A NaN written into the policy at the end of a save step, with save_total_limit 1: the one finite
    checkpoint must stay and resume=auto continue from it."""
    out = _from_checkpoint_2(work, "nan_at_save", straight)
    limit = ["grpo.save_total_limit=1"]
    run = Run(out, ["resume=auto", *limit], env={"CHAOS_NAN_AT_STEP_END": str(STEPS)})
    rc = run.wait()
    kept = complete_checkpoints(out)
    return {"fault": f"NaN in {NAN_PARAM} at a save step", "injected": f"end of step {STEPS}, before checkpoint-"
            f"{STEPS} (save_total_limit=1; continued from checkpoint-2)", "exit_code": rc, "user_saw": run.said(),
            "checkpoints_after_fault": kept, "handled": rc == 1 and kept == ["checkpoint-2"],
            "lost": f"steps 3-{STEPS} (rerun from checkpoint-2, the last finite one)", **resume(out, straight, 2, limit)}


def fault_enospc_at_save(work: Path, straight: Path) -> dict:
    """The disk fills up while checkpoint-4 is written: a clear stop, no crash copy, nothing published."""
    out = _from_checkpoint_2(work, "enospc", straight)
    run = Run(out, ["resume=auto"], env={"CHAOS_ENOSPC_AT_STEP": str(STEPS)})
    rc = run.wait()
    kept, said = complete_checkpoints(out), run.said()
    return {"fault": "disk full (ENOSPC) at a save", "injected": f"torch.save raises ENOSPC in checkpoint-{STEPS} "
            "(continued from checkpoint-2)", "exit_code": rc, "user_saw": said, "checkpoints_after_fault": kept,
            "crash_copy_written": (out / "crash").exists(),
            "handled": rc == 1 and "ENOSPC" in said and kept == ["checkpoint-2"] and not (out / "crash").exists()
            and not (out / f"tmp-checkpoint-{STEPS}").exists(),
            "lost": f"steps 3-{STEPS} (rerun from checkpoint-2 once there is space)", **resume(out, straight, 2)}


def fault_enolck(work: Path, straight: Path) -> dict:
    """No flock() on output_dir's file system (NFSv3 without lockd, Lustre noflock): resume=auto must run."""
    out = _from_checkpoint_2(work, "enolck", straight)
    run = Run(out, ["resume=auto"], env={"CHAOS_ENOLCK": "1"})
    rc = run.wait()
    row = compare(straight, out, 2)
    return {"fault": "no flock() (ENOLCK)", "injected": "flock raises ENOLCK (continued from checkpoint-2)",
            "exit_code": rc, "user_saw": run.said(), "handled": rc == 0,
            "lost": "nothing (an O_EXCL lock file with the same lease)", "resume_exit_code": rc, **row}


def fault_geometry_changed(work: Path, straight: Path) -> dict:
    """resume=auto with another per-device batch size: refused before step 1; then the checkpoint's values."""
    out = _from_checkpoint_2(work, "geometry", straight)
    run = Run(out, ["resume=auto", "grpo.per_device_train_batch_size=4"])
    rc = run.wait()
    said = run.said()
    return {"fault": "a resume with another batch geometry", "injected": "resume=auto with "
            "grpo.per_device_train_batch_size=4 (checkpoint-2 has 8)", "exit_code": rc, "user_saw": said,
            "handled": rc == 2 and "per_device_train_batch_size: 8 in the checkpoint, 4 now" in said,
            "lost": "nothing (refused before step 1)", **resume(out, straight, 2)}


def fault_bad_rows(work: Path, straight: Path) -> dict:
    """A dataset with an empty prompt: refused before step 1, naming the row."""
    data = work / "bad_rows_data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(16)]
    rows[5]["prompt"] = ""
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = work / "bad_rows"
    run = Run(out, [f"data.name={data}", "data.num_examples=null", "grpo.max_steps=1"])
    rc = run.wait()
    said, started = run.said(), (out.parent / f"{out.name}.step-1").exists()
    return {"fault": "an empty prompt in the data", "injected": "row 5 of a 16-row dataset", "exit_code": rc,
            "user_saw": said, "reached_step_1": started, "handled": rc == 2 and "row 5 of the data as loaded" in said and not started,
            "lost": "nothing (refused before step 1)", "resumed_equals_straight": None}


FAULTS = {f.__name__[len("fault_"):]: f for f in (
    fault_kill9_mid_step, fault_kill9_mid_save, fault_sigterm, fault_sigint, fault_rerun_without_resume,
    fault_nan_stop, fault_nan_skip_batch, fault_long_prompt, fault_unsupported_model, fault_torn_checkpoint,
    fault_stale_lock_other_host, fault_nan_at_save_step, fault_enospc_at_save, fault_enolck, fault_geometry_changed,
    fault_bad_rows)}


