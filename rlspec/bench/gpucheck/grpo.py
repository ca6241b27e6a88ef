"""The `grpo` section: a few GRPO steps through SpecGRPOTrainer on the device, seconds per phase.

The policy is a random-weight model of a given shape (SmolLM2-135M's on a GPU) over a carried tokenizer's
vocabulary (no hub there); the data is the embedded arithmetic task. Per step: the rollout (engine), the
weight sync into the engine, and the rest of the step (TRL's logprob passes, loss, optimizer). A machine without
TRL (the GPU machine's python3 has none unless carried) records the section as skipped, and why."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path


def why_not(tokenizer: str | None) -> str | None:
    """Why the section cannot run here (None: it can)."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        return (f"trl/datasets are not importable ({e}); carry them (docs/gpu.md#the-device-check-make-gpu-check) "
                f"or run the section where they are installed")
    if not tokenizer or not Path(tokenizer).is_dir():
        return (f"no tokenizer directory ({tokenizer!r}); pass --tokenizer DIR (a carried copy of the embedded "
                f"model's tokenizer files)")
    return None


def distinct_chars(completions, **kwargs) -> list[float]:
    """A reward random-weight samples differ on, so advantages and the update are nonzero."""
    return [float(len(set(c[0]["content"]))) for c in completions]


def phases(history: list[dict]) -> list[dict]:
    """Per logged step: rollout, weight sync and the rest of the step, seconds."""
    rows = []
    for log in history:
        if "step_time" not in log:
            continue
        rollout, sync, step = log.get("rollout/wall_s"), log.get("rollout/sync_s"), log["step_time"]
        rows.append(dict(step=log.get("step"), step_s=step, rollout_s=rollout, sync_s=sync,
                         train_s=step - (rollout or 0.0), tokens_per_s=log.get("rollout/tokens_per_s")))
    return rows


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, tokenizer, steps, batch, generations, max_completion_length."""
    why = why_not(cfg["tokenizer"])
    if why:
        print(f"grpo: skipped: {why}", flush=True)
        return {"skipped": why}
    import trl
    from transformers import AutoTokenizer

    from rlspec.bench.gpucheck.common import build_hf
    from rlspec.trainers.data import make_math_dataset
    from rlspec.trainers.grpo import SpecGRPOTrainer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(cfg["tokenizer"])
    model = build_hf(cfg["shape"], dtype, device, vocab=len(tok))
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    with tempfile.TemporaryDirectory(prefix="rlspec-gpu-grpo-") as tmp:
        args = trl.GRPOConfig(output_dir=tmp, use_cpu=device.type == "cpu", bf16=device.type == "cuda", seed=0,
                              per_device_train_batch_size=cfg["batch"], num_generations=cfg["generations"],
                              max_completion_length=cfg["max_completion_length"], max_steps=cfg["steps"],
                              logging_steps=1, learning_rate=1e-5, report_to=[], save_strategy="no",
                              disable_tqdm=True)
        trainer = SpecGRPOTrainer(model=model, reward_funcs=[distinct_chars], args=args,
                                  train_dataset=make_math_dataset(4 * cfg["batch"], seed=0), processing_class=tok,
                                  engine_kwargs=dict(max_model_len=512, max_num_seqs=cfg["batch"]))
        setup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        trainer.train()
        out = {"shape": cfg["shape"], "vocab": len(tok), "steps": cfg["steps"], "setup_s": setup_s,
               "train_s": time.perf_counter() - t1, "per_step": phases(trainer.state.log_history)}
        trainer.engine.close()
    for r in out["per_step"]:
        print(f"  step {r['step']}: {r['step_s']:.2f} s (rollout {r['rollout_s']}, sync {r['sync_s']})", flush=True)
    return out
