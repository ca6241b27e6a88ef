"""`python -m rlspec.train config=grpo_math.yaml [key=value ...]`: one RL training run from a recipe.

The config is parsed and checked before torch is imported, so a typo fails in a fraction of a
second. Then: W&B environment, model fetch, data, rewards, the trainer (`trainer: grpo` ->
SpecGRPOTrainer, `trainer: rloo` -> SpecRLOOTrainer, `trainer: ppo` -> PPOTrainer, all rolling out through the same
engine), train.
Checkpoints are written by the Trainer every <grpo|ppo>.save_steps, atomically, with everything a step
depends on (trainers/run/checkpoint.py; the learned drafter in checkpoint-N/drafter); `resume=auto` continues
from the newest complete one, and an output_dir holding a run is refused without resume or
overwrite_output_dir (rlspec/resume.py, docs/resume.md). SIGTERM/SIGINT finish the step, write a
checkpoint and the drafter, and exit 143/130; NaN/inf logits follow `on_nonfinite` (exit 1 on stop). The
final model goes to <output_dir>/final, and a crash saves what the policy is to <output_dir>/crash before
re-raising. Every run ends with a summary table and <output_dir>/summary.json. Under `accelerate launch` each process has its own engine and rank 0
alone writes what belongs to the run (rlspec/distributed.py, docs/distributed.md).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import rlspec.rollout.metrics as M  # plain Python: the CLI stays light
from rlspec.config import Config, ConfigError, format_help, load_config

DEFAULT_CONFIG = "grpo_math.yaml"

USAGE = f"""usage: python -m rlspec.train [config=NAME_OR_PATH] [key=value ...]

config defaults to {DEFAULT_CONFIG} (looked up in ./, ./configs/ and the recipes installed with rlspec).
Overrides use dotted keys and YAML values: grpo.max_steps=3 drafter.drafter=suffix rewards=[accuracy,format]
Keys:"""


def main(argv: list[str] | None = None) -> int:
    """Run training; returns the process exit code (2 for a config error, printed without a traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE + "\n" + format_help())
        return 0
    try:
        cfg = parse_args(argv)
        run(cfg)
    except ConfigError as e:
        print(f"rlspec.train: config error: {e}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a stop the run planned for exits with its code, not a traceback
        code = _planned_exit_code(exc)
        if code is None:
            raise
        print(f"rlspec.train: {exc}", file=sys.stderr)
        return code
    return 0


def _planned_exit_code(exc: Exception) -> int | None:
    """The exit code of a stop the run planned for, printed as a message rather than a traceback: 2 for input
    refused before step 1 (a prompt too long for the context, a model feature the runtime does not compute,
    an output_dir another process holds: OutputDirLocked), 128 + signal for a signal stop (TrainingInterrupted),
    1 for on_nonfinite=stop and a lost rollout backend (both wrote a checkpoint first) and a checkpoint some
    process could not write (CheckpointSaveFailed, on every process); None otherwise."""
    from rlspec.rollout.errors import NonFiniteLogitsError, PromptTooLongError, RolloutBackendLost, UnsupportedModelError

    if isinstance(exc, (PromptTooLongError, UnsupportedModelError)):
        return 2
    if isinstance(exc, (NonFiniteLogitsError, RolloutBackendLost)):
        return 1
    planned = ("TrainingInterrupted", "OutputDirLocked", "StoppedBySignal", "DatasetRowError", "GeometryChanged",
               "CheckpointSaveFailed")
    return getattr(exc, "exit_code", None) if type(exc).__name__ in planned else None


def parse_args(argv: list[str]) -> Config:
    """`config=...` picks the recipe; every other argument is a key=value override."""
    config_name, overrides = DEFAULT_CONFIG, []
    for arg in argv:
        if arg.lstrip("-").startswith("config="):
            config_name = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return load_config(config_name, overrides)


def run(cfg: Config) -> dict[str, Any]:
    """Train as configured; returns the summary (also written to <output_dir>/summary.json). output_dir must be
    a directory of the run's own, and one process at a time writes it: the run holds <output_dir>/rlspec.lock
    from before it touches the directory until it returns (rlspec/resume.py, trainers/run/run_lock.py)."""
    from rlspec.resume import output_dir_lock, resolve_output_dir

    out = resolve_output_dir(cfg.output_dir)
    with _sigterm_raises(), output_dir_lock(out, main_process=_launch_rank() == 0):
        return _run(cfg, out)


class StoppedBySignal(Exception):
    """SIGTERM outside the training loop (the model load, the drafter warm start, the final save): the run ends
    through an exception, so the lock is released and nothing half-done is taken for done. exit_code: 143."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"{signal.Signals(signum).name} received before training started or after it ended: "
                         "stopped; continue with resume=auto")
        self.exit_code = 128 + signum


@contextlib.contextmanager
def _sigterm_raises():
    """From before the model loads: SIGTERM (Slurm and Kubernetes stop a job with it) raises StoppedBySignal
    where it would end the process at once; inside train() the trainers' own handler stops at a step's end with
    a checkpoint instead. SIGINT needs nothing: Python already raises KeyboardInterrupt. A handler the caller
    installed is left in place; a no-op off the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise StoppedBySignal(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run(cfg: Config, out: Path) -> dict[str, Any]:
    from rlspec.resume import prepare_output_dir, set_wandb_run_id

    # before the model fetch: a used output_dir is refused in a second, not after minutes of loading
    resume_from = prepare_output_dir(cfg, out, main_process=_launch_rank() == 0)
    out.mkdir(parents=True, exist_ok=True)
    setup_wandb_env(cfg, out)
    set_wandb_run_id(resume_from)
    trainer, summary_cb = build_trainer(cfg, out)
    from rlspec.distributed import is_main_process, main_process_first, save_crash_model
    from rlspec.rollout.errors import NonFiniteLogitsError, RolloutBackendLost
    from rlspec.trainers.run.checkpoint import GeometryChanged
    from rlspec.trainers.run.interrupts import TrainingInterrupted
    from rlspec.trainers.run.save_agreement import CheckpointSaveFailed

    main = is_main_process(trainer)
    start, status, error, warm = time.time(), "finished", None, None
    try:
        if resume_from is None:  # a resumed engine gets its drafter from the checkpoint
            # rank 0 warms (or loads) the drafter and fills the cache first; the others then load rank 0's
            with main_process_first(trainer.args, "drafter warm start"):
                warm = warm_start_drafter(cfg, trainer)
        trainer.train(resume_from_checkpoint=resume_from)
        trainer.save_final_model(out / "final")  # through a temporary directory; a collective under ZeRO-3
    except GeometryChanged:  # refused before step 1: nothing ran; the previous run's drafter and summary stay
        status = "refused"
        _close_engine(trainer)
        raise
    except (TrainingInterrupted, StoppedBySignal, NonFiniteLogitsError, RolloutBackendLost,
            CheckpointSaveFailed) as exc:  # planned; a failed save writes no crash copy (its disk refused one)
        status = "interrupted" if isinstance(exc, (TrainingInterrupted, StoppedBySignal)) else \
            "nonfinite" if isinstance(exc, NonFiniteLogitsError) else \
            "save_failed" if isinstance(exc, CheckpointSaveFailed) else "backend_lost"
        error = f"{type(exc).__name__}: {exc}"
        raise
    except (Exception, KeyboardInterrupt) as exc:
        status, error = "crashed", f"{type(exc).__name__}: {exc}"
        print(f"rlspec.train: training stopped by {error}", file=sys.stderr)
        traceback.print_exc()
        _save_crash(trainer, out, main, save_crash_model)
        raise
    finally:
        if status != "refused":
            export_byproduct_drafter(cfg, trainer, out, main)  # on the crash path too: never lose the drafter
        _finish_wandb()  # first, so the summary table is the last thing printed
        if status == "refused":
            summary = {"status": status}
        elif main:
            summary = summarize(cfg, out, summary_cb.rows, trainer.state.log_history, time.time() - start, status,
                                error, warm)
        else:  # summary.json and the table are the run's, written by rank 0
            summary = {"status": status, "error": error, "process_index": trainer.args.process_index}
    return summary


def _close_engine(trainer) -> None:
    engine = getattr(trainer, "engine", None)
    if engine is not None and getattr(engine, "has_learned_drafter", False):
        engine.close()  # its drafter trainer's thread or process


def _save_crash(trainer, out: Path, main: bool, save_crash_model) -> None:
    """The crash path's copy of the policy in <output_dir>/crash, unless a complete checkpoint of this very step
    holds it already (no second full copy on a disk that may be full) or a `crash` of the user's is there."""
    from rlspec.trainers.run import checkpoint_dirs as dirs
    from rlspec.trainers.run import run_files

    saved = out / dirs.checkpoint_name(trainer.state.global_step)
    if dirs.is_complete(saved):
        if main:
            print(f"rlspec.train: the policy after step {trainer.state.global_step} is in {saved}; no crash copy "
                  "written", file=sys.stderr)
        return
    if main and not run_files.claim(out, "crash"):
        print(f"rlspec.train: {out / 'crash'} is not rlspec's: no crash copy written (the newest checkpoint "
              "stands in for it)", file=sys.stderr)
        return
    if main:
        print(f"rlspec.train: saving the policy after step {trainer.state.global_step} to {out / 'crash'}",
              file=sys.stderr)
    save_crash_model(trainer, out / "crash")


def _launch_rank() -> int:
    """This process's rank as `accelerate launch` / torchrun export it (0 when started alone)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def setup_wandb_env(cfg: Config, out: Path) -> None:
    """W&B reads its settings from the environment: mode (an env WANDB_MODE wins), dir and project."""
    os.environ.setdefault("WANDB_MODE", cfg.wandb.mode)
    wandb_dir = Path(cfg.wandb.dir).expanduser() if cfg.wandb.dir else out / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    os.environ["WANDB_DIR"] = str(wandb_dir)
    os.environ["WANDB_PROJECT"] = cfg.wandb.project


def build_trainer(cfg: Config, out: Path):
    """Fetch the model, load data and rewards, and construct SpecGRPOTrainer or PPOTrainer (heavy imports
    start here). Both take the same arguments: the engine, speculation and summary are shared."""
    from transformers import AutoTokenizer

    from rlspec.distributed import DrafterCheckpointCallback, main_process_first
    from rlspec.trainer_args import build_trainer_args
    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.trainers.callbacks import RolloutSummaryCallback
    from rlspec.trainers.data import load_dataset_by_name
    from rlspec.trainers.rewards import get_reward_funcs

    args = build_trainer_args(cfg, out)  # before the model fetch: an extra-key typo should fail fast
    reward_funcs = get_reward_funcs(cfg.rewards)
    with main_process_first(args, "model fetch"):  # one conversion into the shared cache, not one per rank
        model_dir = fetch_model(cfg.model)
    print(f"rlspec.train: model {cfg.model} -> {model_dir}; output_dir {out}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # TRL pads completions; SmolLM2-style models reuse EOS
    summary_cb = RolloutSummaryCallback()
    drafter_cb = DrafterCheckpointCallback(export=cfg.drafter.export)
    trainer = _trainer_class(cfg.trainer)(
        model=model_dir,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=load_data(cfg, load_dataset_by_name),
        processing_class=tokenizer,
        spec_config=cfg.drafter,  # the drafter section is the engine's SpecConfig
        # the training pass's precision (float32 where the CPU has no native bf16: trainer_args._bf16)
        engine_kwargs=dict(dtype="bfloat16" if args.bf16 else "float32", **cfg.rollout.engine_kwargs()),
        callbacks=[summary_cb, drafter_cb, _wandb_config_callback(cfg)],
        on_nonfinite=cfg.on_nonfinite,
        drop_long_prompts=cfg.data.drop_long_prompts,
        **_partial_rollouts(cfg),
    )
    drafter_cb.engine = trainer.engine
    return trainer, summary_cb


def _partial_rollouts(cfg: Config) -> dict:
    """SpecGRPOTrainer's partial_rollouts argument from the config's section (absent when off)."""
    p = cfg.partial_rollouts
    if not p.enabled:
        return {}
    return {"partial_rollouts": dict(oversample=p.oversample, max_staleness=p.max_staleness)}


def _trainer_class(name: str):
    if name == "ppo":
        from rlspec.trainers.ppo.trainer import PPOTrainer

        return PPOTrainer
    if name == "rloo":
        from rlspec.trainers.rloo import SpecRLOOTrainer

        return SpecRLOOTrainer
    from rlspec.trainers.grpo import SpecGRPOTrainer

    return SpecGRPOTrainer


def warm_start_drafter(cfg: Config, trainer) -> dict | None:
    """Warm the learned drafter on the target's own rollouts of the run's prompts before the first RL
    step (or load the cached result for these weights); None when there is nothing to warm."""
    from dataclasses import asdict

    engine = trainer.engine  # None: SpecGRPOTrainer generates through TRL (a model the engine cannot run)
    if engine is None or not engine.has_learned_drafter or cfg.drafter.warm_start_s <= 0 or cfg.drafter.drafter_path:
        return None
    from rlspec.trainers.data import prompt_token_ids

    convs = trainer.train_dataset["prompt"][:cfg.drafter.warm_start_prompts]
    prompts = prompt_token_ids(trainer.processing_class, convs)
    algo = cfg.algorithm
    result = engine.warm_start_drafter(prompts, budget_s=cfg.drafter.warm_start_s, group=algo.num_generations,
                                       max_new_tokens=algo.max_completion_length, temperature=algo.temperature)
    engine.stats()  # drop the warm-up's rollout metrics: step 1's figures are step 1's alone
    how = "loaded from the cache" if result.cached else \
        f"{result.steps} steps on {result.tokens} tokens in {result.seconds:.0f} s, cached"
    print(f"rlspec.train: drafter warm start {how}: {result.path}", flush=True)
    return asdict(result)


def load_data(cfg: Config, load_dataset_by_name):
    """The data section mapped onto trainers.data.load_dataset_by_name's keyword arguments."""
    d = cfg.data
    kwargs: dict[str, Any] = {}
    if d.name == "embedded_math":
        kwargs.update(max_operand=d.max_operand, ops=tuple(d.ops))
    elif d.subset is not None:
        kwargs["config"] = d.subset
    kwargs.update(d.extra)
    return load_dataset_by_name(d.name, split=d.split, num_examples=d.num_examples, seed=d.seed, **kwargs)


def summarize(cfg: Config, out: Path, rows: list[dict], log_history: list[dict], wall_s: float, status: str,
              error: str | None, warm_start: dict | None = None) -> dict:
    """Print the per-step table and a one-line digest; write summary.json. Never raises: it also runs
    on the crash path, where an error here must not hide the original one."""
    try:
        return _summarize(cfg, out, rows, log_history, wall_s, status, error, warm_start)
    except Exception as exc:  # noqa: BLE001
        print(f"rlspec.train: could not write the summary: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {"status": status, "error": error}


def _summarize(cfg: Config, out: Path, rows: list[dict], log_history: list[dict], wall_s: float, status: str,
               error: str | None, warm_start: dict | None) -> dict:
    from rlspec.trainers.callbacks import format_summary_table

    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    timed = [r for r in rows if r.get("rollout_s") is not None and r.get("step_s")]
    # Tokens over seconds summed across steps: a mean of per-step rates would overweight short steps.
    gen = [(h[M.GENERATED_TOKENS], h[M.TIME_S]) for h in log_history
           if M.GENERATED_TOKENS in h and h.get(M.TIME_S)]
    summary = {
        "status": status,
        "error": error,
        "steps": rows[-1]["step"] if rows else 0,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "rollout_share": sum(r["rollout_s"] for r in timed) / sum(r["step_s"] for r in timed) if timed else None,
        "tokens_per_s": sum(t for t, _ in gen) / sum(s for _, s in gen) if gen else None,
        "wall_s": wall_s,
        "final_model": str(out / "final") if status == "finished" else None,
        "crash_model": str(out / "crash") if (out / "crash").is_dir() else None,
        "checkpoints": sorted(str(p) for p in out.glob("checkpoint-*")),
        "drafter_warm_start": warm_start,
        "rows": rows,
        # per logged step: the engine's, drafter's and TRL's sampling metrics (for benchmarks/plots)
        "history": [{k: v for k, v in h.items() if k == "step" or k.startswith(_HISTORY_PREFIXES)}
                    for h in log_history if any(k.startswith(_HISTORY_PREFIXES) for k in h)],
        "config": cfg.to_dict(),
    }
    print(format_summary_table(rows))
    print(_digest(summary))
    from rlspec.trainers.run import run_files

    if run_files.claim(out, "summary.json"):
        write_new_file(out / "summary.json", json.dumps(summary, indent=2, default=str))
    else:
        print(f"rlspec.train: {out / 'summary.json'} is not rlspec's (or a symlink): the summary is not written "
              "there", file=sys.stderr)
    return summary


def write_new_file(path: Path, text: str) -> None:
    """Write a file of the run's through a temporary name and a rename: never through a symlink."""
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# (loss/, val/, objective/, policy/: PPO's curves, for `python -m rlspec.bench ppo`)
_HISTORY_PREFIXES = ("rollout/", "drafter/", "strategy/", "sampling/", "vllm/", "reward", "loss/", "val/", "objective/",
                     "policy/")


def _digest(s: dict) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    share = None if s["rollout_share"] is None else 100 * s["rollout_share"]
    return (f"{s['status']}: {s['steps']} steps in {s['wall_s']:.0f} s | reward {num(s['reward_first'], '.3f')} -> "
            f"{num(s['reward_last'], '.3f')} | rollouts {num(share, '.0f')}% of step time | "
            f"{num(s['tokens_per_s'], '.1f')} tok/s | final model: {s['final_model'] or '-'}")


def export_byproduct_drafter(cfg: Config, trainer, out: Path, main: bool = True) -> str | None:
    """Export a learned drafter to <output_dir>/drafter (EAGLE-3 format) and stop its training thread.
    Best effort: a failing export is reported, never raised over the run's own outcome.

    main: whether this process writes the run's outputs. With several processes each rank's engine has
    its own drafter (warm-started from rank 0's, then trained online on that rank's rollouts); the run's
    drafter is rank 0's (docs/distributed.md), and the other ranks only stop theirs."""
    engine = getattr(trainer, "engine", None)
    if engine is None or not engine.has_learned_drafter:
        return None
    engine.close()
    if not cfg.drafter.export or not main:
        return None
    from rlspec.trainers.run import run_files

    if not run_files.claim(out, "drafter"):
        print(f"rlspec.train: {out / 'drafter'} is not rlspec's: the drafter is not exported there (each "
              "checkpoint-N/drafter holds it)", file=sys.stderr)
        return None
    try:
        path = engine.export_drafter(str(out / "drafter"))
        print(f"rlspec.train: exported the drafter to {path}", flush=True)
        return path
    except Exception as exc:  # noqa: BLE001
        print(f"rlspec.train: could not export the drafter: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _wandb_config_callback(cfg: Config):
    """A callback that adds the whole rlspec config to the W&B run (the Trainer only logs GRPOConfig)."""
    from transformers import TrainerCallback

    class WandbConfigCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            wandb = sys.modules.get("wandb")  # imported by transformers' WandbCallback, which runs first
            if wandb is not None and getattr(wandb, "run", None) is not None:
                wandb.run.config.update({"rlspec": cfg.to_dict()}, allow_val_change=True)

    return WandbConfigCallback()


def _finish_wandb() -> None:
    """Close the W&B run so an offline run directory is complete when main() returns, and drop W&B's
    process-wide settings, which it reads from the environment once: a later run() in this process (a
    resume, a notebook's second run) then logs under its own WANDB_DIR and WANDB_RUN_ID."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
    if wandb is not None and hasattr(wandb, "teardown"):
        wandb.teardown()


if __name__ == "__main__":
    sys.exit(main())
