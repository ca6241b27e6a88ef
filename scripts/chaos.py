"""Chaos: every fault rlspec handles, injected into short real runs of the embedded model.

Each fault runs `python -m rlspec.train config=grpo_math.yaml` on SmolLM2-135M (float32, suffix speculation
with `drafter.selector=always`, 4 steps, a checkpoint every 2), injects the fault, does what README.md's
"When a run crashes" tells a user to type (mostly `resume=auto`), and compares the result with an
uninterrupted run of the same config and seed: the rewards logged after the resume point and the final
weights (largest absolute difference). Signals and `kill -9` come from outside the process, as a scheduler
or a user sends them; the only hooks inside the run (this script's --child mode) mark when a step begins
(so a fault lands in a known step) and poison one weight for the NaN faults.

    python scripts/chaos.py                      # every fault, ~15 min on 2 CPU cores
    python scripts/chaos.py --only kill9_mid_step,nan_stop

Writes bench_out/chaos.json: per fault, when it was injected, what the user saw (exit code, the message),
what was lost, and whether the continued run equals the straight one.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, parser, summary_of, table, write_json

STEPS, SAVE_STEPS = 4, 2
BASE = ["config=grpo_math.yaml", "dtype=float32", f"grpo.max_steps={STEPS}", f"grpo.save_steps={SAVE_STEPS}",
        "grpo.save_total_limit=2", "grpo.max_completion_length=48", "grpo.learning_rate=1e-4",
        "data.num_examples=64", "drafter.drafter=suffix", "drafter.selector=always", "wandb.mode=offline"]
NAN_PARAM = "model.layers.3.mlp.down_proj.weight"  # any weight; one NaN in it makes every logit NaN


# -- the child: rlspec.train.main with the injection hooks ----------------------------------------------

def child(argv: list[str]) -> int:
    """rlspec.train.main(argv) plus the hooks: <output_dir>.step-<k> is written when step k begins;
    CHAOS_NAN_AT_STEP=k puts a NaN into NAN_PARAM when step k begins (CHAOS_NAN_HEAL=1 restores it
    when the step ends: a transient fault)."""
    import rlspec.train as train
    from transformers import TrainerCallback

    nan_at, heal = int(os.environ.get("CHAOS_NAN_AT_STEP", 0)), os.environ.get("CHAOS_NAN_HEAL") == "1"

    class Hooks(TrainerCallback):
        saved = None

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            step = state.global_step + 1
            out = Path(args.output_dir)
            (out.parent / f"{out.name}.step-{step}").touch()  # beside output_dir: not part of the run
            if step == nan_at:
                param = dict(model.named_parameters())[NAN_PARAM]
                self.saved = param.detach().clone()
                with __import__("torch").no_grad():
                    param.view(-1)[0] = float("nan")

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if heal and self.saved is not None:
                with __import__("torch").no_grad():
                    dict(model.named_parameters())[NAN_PARAM].copy_(self.saved)
                self.saved = None

    build = train.build_trainer

    def build_with_hooks(cfg, out):
        trainer, summary_cb = build(cfg, out)
        trainer.add_callback(Hooks())
        return trainer, summary_cb

    train.build_trainer = build_with_hooks
    return train.main(argv)


# -- the parent: start, inject, continue, compare --------------------------------------------------------

class Run:
    """One `rlspec.train` process of the chaos config (via --child), its output and exit code."""

    def __init__(self, out: Path, extra: list[str] = (), env: dict | None = None):
        self.out, self.extra = out, list(extra)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
        for var in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
            env.pop(var, None)
        self.log = out.parent / f"{out.name}.log"
        self.start = self.log.stat().st_size if self.log.exists() else 0  # a resumed run appends: read its part
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", *BASE, f"output_dir={out}", *self.extra],
                                     cwd=ROOT, env=env, stdout=self.log.open("a"), stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 900) -> int:
        return self.proc.wait(timeout=timeout)

    def wait_for(self, path: Path, timeout: float = 600, poll: float = 0.02) -> None:
        deadline = time.time() + timeout
        while not path.exists():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{path} never appeared (rc {self.proc.returncode}); see {self.log}")
            time.sleep(poll)

    def said(self) -> str:
        """The lines a user reads first: rlspec's own messages (not the Trainer's logging)."""
        keep = ("rlspec", "Error", "error:", "refused", "skips", "resuming", "dropped", "SIG")
        with self.log.open("rb") as f:
            f.seek(self.start)
            text = f.read().decode(errors="replace")
        lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines()
                 if not ln.startswith("rlspec.train: model ")]
        return " | ".join(ln[:400] for ln in lines if any(k in ln for k in keep) and "Warning" not in ln)[-1500:]


def history(out: Path) -> dict[int, float]:
    summary = summary_of(out)
    return {} if summary is None else {h["step"]: h["reward"] for h in summary["history"] if "reward" in h}


def max_weight_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def complete_checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*") if (p / "rlspec_complete.json").is_file()),
                  key=lambda n: int(n.rsplit("-", 1)[1]))


def compare(straight: Path, resumed: Path, after_step: int) -> dict:
    """Rewards of steps after_step+1.. and the final weights of the continued run against the straight one."""
    a, b = history(straight), history(resumed)
    steps = [s for s in range(after_step + 1, STEPS + 1)]
    same_rewards = bool(steps) and all(s in a and s in b and a[s] == b[s] for s in steps)
    diff = max_weight_diff(straight / "final", resumed / "final") if (resumed / "final").is_dir() else None
    return {"rewards_after_resume_equal": same_rewards, "final_weights_max_abs_diff": diff,
            "resumed_equals_straight": same_rewards and diff is not None and diff <= 1e-5}


def resume(out: Path, straight: Path, after_step: int, extra: list[str] = ()) -> dict:
    run = Run(out, ["resume=auto", *extra])
    rc = run.wait()
    return {"resume_exit_code": rc, "resume_said": run.said(), **compare(straight, out, after_step)}


# -- the faults ------------------------------------------------------------------------------------------

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
    from rollout.runtime.model.fetch import fetch_model

    model = work / "longrope_model"
    if not model.is_dir():
        shutil.copytree(fetch_model("smollm2-135m-instruct"), model)
        cfg = json.loads((model / "config.json").read_text())
        cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
        (model / "config.json").write_text(json.dumps(cfg))
    out = work / "unsupported"
    run = Run(out, [f"model={model}"])
    rc = run.wait()
    return {"fault": "a model feature the runtime does not compute", "injected": "rope_scaling dynamic in config.json",
            "exit_code": rc, "user_saw": run.said(), "reached_step_1": bool(history(out)),
            "lost": "nothing (refused at load)", "resumed_equals_straight": None}


FAULTS = {f.__name__[len("fault_"):]: f for f in (
    fault_kill9_mid_step, fault_kill9_mid_save, fault_sigterm, fault_sigint, fault_rerun_without_resume,
    fault_nan_stop, fault_nan_skip_batch, fault_long_prompt, fault_unsupported_model)}


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--only", default="", help=f"comma-separated faults (default: all of {','.join(FAULTS)})")
    p.add_argument("--workdir", default="outputs/chaos")
    p.add_argument("--out", default="bench_out/chaos.json")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(FAULTS)
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        p.error(f"unknown faults {unknown}; choose from {sorted(FAULTS)}")
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.time()
    straight = work / "straight"
    rc = Run(straight).wait()
    if rc != 0:
        raise SystemExit(f"the straight run failed (rc {rc}); see {straight}.log")
    moved = max_weight_diff(straight / "final", straight / "checkpoint-2")
    rows = []
    for name in names:
        start = time.time()
        try:
            row = FAULTS[name](work, straight)
        except Exception as exc:  # noqa: BLE001 - one fault's harness failure must not hide the others
            row = {"fault": name, "harness_error": f"{type(exc).__name__}: {exc}", "resumed_equals_straight": False}
        row.update(name=name, wall_s=round(time.time() - start, 1))
        rows.append(row)
        print(f"[chaos] {name}: exit {row.get('exit_code')}, resumed = straight: {row.get('resumed_equals_straight')}",
              flush=True)
    print(table(rows, ["name", "injected", "exit_code", "lost", "resumed_equals_straight"]))
    write_json(args.out, {"config": BASE, "straight_rewards": history(straight),
                          "policy_moved_steps_3_4_max_abs": moved, "faults": rows,
                          "wall_s": round(time.time() - t0, 1)})
    return 0 if all(r.get("resumed_equals_straight") is not False for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    sys.exit(main())
