"""The faults `python -m rlspec.bench chaos` injects, one function each: (work dir, straight run) -> its row."""
from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

from rlspec.bench.chaos_run import NAN_PARAM, STEPS, Run, complete_checkpoints, history, resume, summary_of

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


FAULTS = {f.__name__[len("fault_"):]: f for f in (
    fault_kill9_mid_step, fault_kill9_mid_save, fault_sigterm, fault_sigint, fault_rerun_without_resume,
    fault_nan_stop, fault_nan_skip_batch, fault_long_prompt, fault_unsupported_model)}


