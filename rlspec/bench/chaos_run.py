"""The machinery of `python -m rlspec.bench chaos`: one `rlspec.train` process of the chaos config with the
injection hooks (`--child`), what it said, and the comparison of a continued run with the straight one."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rlspec.bench.common import summary_of
from rlspec.bench.harness import ROOT

STEPS, SAVE_STEPS = 4, 2
BASE = ["config=grpo_math.yaml", "dtype=float32", f"grpo.max_steps={STEPS}", f"grpo.save_steps={SAVE_STEPS}",
        "grpo.save_total_limit=2", "grpo.max_completion_length=48", "grpo.learning_rate=1e-4",
        "data.num_examples=64", "drafter.drafter=suffix", "drafter.selector=always", "wandb.mode=offline"]
# key=value every Run adds after BASE: a smoke run's tiny model and short completions (set by chaos.run)
OVERRIDES: list[str] = []
NAN_PARAM = "model.layers.3.mlp.down_proj.weight"  # any weight; one NaN in it makes every logit NaN


# -- the child: rlspec.train.main with the injection hooks ----------------------------------------------

def child(argv: list[str]) -> int:
    """rlspec.train.main(argv) plus the hooks: <output_dir>.step-<k> is written when step k begins;
    CHAOS_NAN_AT_STEP=k puts a NaN into NAN_PARAM when step k begins (CHAOS_NAN_HEAL=1 restores it
    when the step ends: a transient fault); CHAOS_NAN_AT_STEP_END=k when step k ends (before its save);
    CHAOS_ENOSPC_AT_STEP=k: the disk is full from step k's checkpoint on; CHAOS_ENOLCK=1: no flock()."""
    import rlspec.train as train
    from transformers import TrainerCallback

    nan_at, heal = int(os.environ.get("CHAOS_NAN_AT_STEP", 0)), os.environ.get("CHAOS_NAN_HEAL") == "1"
    nan_at_end = int(os.environ.get("CHAOS_NAN_AT_STEP_END", 0))
    full_at = int(os.environ.get("CHAOS_ENOSPC_AT_STEP", 0))
    if os.environ.get("CHAOS_ENOLCK") == "1":
        _no_flock()

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
            if state.global_step == nan_at_end:  # after the optimizer, before the Trainer's save of this step
                with __import__("torch").no_grad():
                    dict(model.named_parameters())[NAN_PARAM].view(-1)[0] = float("nan")
            if heal and self.saved is not None:
                with __import__("torch").no_grad():
                    dict(model.named_parameters())[NAN_PARAM].copy_(self.saved)
                self.saved = None

    build = train.build_trainer

    def build_with_hooks(cfg, out):
        trainer, summary_cb = build(cfg, out)
        trainer.add_callback(Hooks())
        if full_at:
            _full_disk_at(trainer, full_at)
        return trainer, summary_cb

    train.build_trainer = build_with_hooks
    return train.main(argv)


def _full_disk_at(trainer, step: int) -> None:
    """torch.save (the optimizer, RNG and rlspec state of a checkpoint) raises ENOSPC from step `step` on."""
    import errno

    import torch

    save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if trainer.state.global_step >= step:
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return save(obj, f, *args, **kwargs)

    torch.save = full_disk


def _no_flock() -> None:
    """flock() fails with ENOLCK, as on NFSv3 without lockd or Lustre mounted noflock."""
    import errno

    from rlspec.trainers.run import run_lock

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    run_lock.fcntl.flock = flock


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
        argv = [*BASE, *OVERRIDES, f"output_dir={out}", *self.extra]
        self.proc = subprocess.Popen([sys.executable, "-m", "rlspec.bench.chaos", "--child", *argv], cwd=ROOT, env=env,
                                     stdout=self.log.open("a"), stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 3600) -> int:  # a hang detector: a run of 4 steps on a busy 2-core CPU took 30 min
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


