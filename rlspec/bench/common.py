"""What the benchmarks share besides the harness: the embedded math task, the transformers baseline, engines'
tokenizer and EOS ids, timed generate calls and decode steps, random-weight model shapes, and the `rlspec.train`
runs the end-to-end benchmarks compare.

Nothing heavy at import (torch, transformers and the repo's packages only inside the helpers).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rlspec.bench.harness import child_env

EMBEDDED = "smollm2-135m-instruct"
# SmolLM2-135M's and a tiny Llama's shape (transformers LlamaConfig fields), for random-weight models: step
# time does not depend on the weights' values
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
# A smoke run's dtype: float32 keeps the CPU step eager (bf16 compiles it first, which takes minutes)
SMOKE_DTYPE = "float32"


def math_task(tokenizer, n: int, seed: int = 0, max_operand: int = 9, ops=("+",)) -> tuple[list[list[int]], list[str]]:
    """(chat-templated prompt token ids, answers) of `n` embedded arithmetic problems (the default run's data)."""
    from rlspec.trainers.data import make_math_dataset, prompt_token_ids

    data = make_math_dataset(num_examples=n, seed=seed, max_operand=max_operand, ops=ops)
    return prompt_token_ids(tokenizer, data["prompt"]), list(data["answer"])


def math_prompts(tokenizer, n: int, seed: int = 0, max_operand: int = 9, ops=("+",)) -> list[list[int]]:
    """Chat-templated token ids of the embedded arithmetic problems."""
    return math_task(tokenizer, n, seed, max_operand, ops)[0]


def hf_model(model: str, dtype, device: str = "cpu", **tokenizer_kw):
    """(tokenizer, transformers model in eval mode on `device`) of `model`: a local directory, a hub id or the
    embedded alias; tokenizer_kw go to AutoTokenizer (e.g. padding_side="left" to batch prompts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlspec.rollout.runtime.model.fetch import fetch_model

    path = fetch_model(model)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return AutoTokenizer.from_pretrained(path, **tokenizer_kw), hf


def tokenizer_and_eos(model: str, dtype: str = "bfloat16"):
    """The tokenizer and EOS ids RolloutEngine.from_pretrained uses for `model`, for engines built from loaded
    weights (the engine that found them is dropped)."""
    from rlspec.rollout.engine import RolloutEngine

    base = RolloutEngine.from_pretrained(model, dtype=dtype)
    return base.tokenizer, list(base.eos_token_ids)


def completion_tokens(results) -> int:
    """Tokens generated over the results of one generate call."""
    return sum(len(r.completion_ids) for r in results)


def timed_generate(engine, prompts, params, **kw) -> tuple[list, int, float]:
    """One `generate` call of an engine, worker pool or backend by the wall clock: (results, tokens, seconds)."""
    t0 = time.perf_counter()
    results = engine.generate(prompts, params, **kw)
    seconds = time.perf_counter() - t0
    return results, completion_tokens(results), seconds


def timed_on(fn, device) -> tuple[object, float]:
    """(fn(), seconds) of one call, the device's queued work waited for before and after (runtime/device.py's
    DeviceTimer: the one timer of the engine, its cost model and the benchmarks)."""
    from rlspec.rollout.runtime.device import DeviceTimer

    with DeviceTimer(device) as clock:
        value = fn()
    return value, clock.seconds


def time_steps(run, iters: int, device, warmup: int = 2) -> float:
    """Seconds per `run()` after `warmup` untimed calls (they capture, for a graph pool)."""
    for _ in range(warmup):
        run()
    return timed_on(lambda: [run() for _ in range(iters)], device)[1] / iters


def release_cached(device) -> None:
    """Hand the CUDA caching allocator's free blocks back between models (a no-op on CPU)."""
    if getattr(device, "type", device) == "cuda":
        import torch

        torch.cuda.empty_cache()


def summary_of(out: Path) -> dict | None:
    """The summary.json `rlspec.train` wrote in the run directory `out`, or None where there is none (yet)."""
    path = Path(out) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


# A smoke run of a training benchmark: one step, eager (float32), short completions (smoke_train adds the model)
SMOKE_TRAIN = ["dtype=float32", "grpo.max_completion_length=8", "grpo.save_steps=1000", "data.num_examples=16",
               "wandb.mode=disabled"]


def tiny_model(path: str):
    """A random-weight model of the checkpoint at `path`'s architecture and vocabulary, 2 layers of width 64: a
    smoke run's model. The pipeline (engine, drafters, the trainer's step) is the same as with the real weights; a
    step costs milliseconds instead of the seconds a 135M model's forward and backward take on a CPU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:2]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def smoke_model(model: str, beside) -> str:
    """--smoke: `model`, unless it is the embedded default: then a directory tiny-smollm2 beside the path `beside`
    (the report, a run directory) holding tiny_model of it with the real tokenizer, chat template and generation
    config (prompts, EOS ids and rewards stay real), written once. A model the user named is kept."""
    import os
    import shutil
    import tempfile

    from rlspec.rollout.runtime.model.fetch import fetch_model

    if model != EMBEDDED:
        return model
    src, dest = Path(fetch_model(EMBEDDED)), Path(beside).parent / "tiny-smollm2"
    if not (dest / "config.json").is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".tiny-smollm2-") as tmp:
            tiny_model(str(src)).save_pretrained(tmp)
            for f in src.iterdir():  # after save_pretrained: the real generation config replaces the one it derived
                if f.is_file() and f.name not in ("config.json", "model.safetensors", "rlspec_fetch.json"):
                    shutil.copy2(f, Path(tmp) / f.name)
            try:  # whole or not at all: a smoke run beside this one may have written it meanwhile
                os.rename(tmp, dest)
            except OSError:
                if not (dest / "config.json").is_file():
                    raise
    return str(dest)


def smoke_train(beside, section: str = "grpo") -> list[str]:
    """A smoke run's `rlspec.train` overrides: SMOKE_TRAIN (its keys in the trainer's `section`) and smoke_model's
    tiny model."""
    return [*(o.replace("grpo.", f"{section}.") for o in SMOKE_TRAIN), f"model={smoke_model(EMBEDDED, beside)}"]


def train_run(tag: str, out: Path, config: str, steps: int, overrides: list[str], in_process: bool = False) -> dict:
    """`python -m rlspec.train config=<config> grpo.max_steps=<steps> output_dir=<out> <overrides>` in a process of its own (W&B and threads start clean) unless `in_process` (a smoke run: the imports are
    paid once), the command echoed after `[tag]`; returns the run's summary.json."""
    argv = [f"config={config}", f"grpo.max_steps={steps}", f"output_dir={out}", *overrides]
    print(f"[{tag}] python -m rlspec.train", " ".join(argv), flush=True)
    if in_process:
        from rlspec.train import main

        rc = main(argv)
        if rc:
            raise SystemExit(f"[{tag}] rlspec.train exited with {rc}")
    else:
        subprocess.run([sys.executable, "-m", "rlspec.train", *argv], env=child_env(), check=True)
    return json.loads((Path(out) / "summary.json").read_text())


def rollout_seconds(summary: dict) -> float:
    """Seconds a finished run spent in its rollout phases (the per-step rows of its summary.json)."""
    return sum(r.get("rollout_s") or 0 for r in summary["rows"])
