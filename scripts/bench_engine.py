"""Shared bits of the benchmark scripts that build what they measure and time it: the random-weight model
shapes, the transformers baseline, the engine's tokenizer and EOS ids, wall-clock timing of generate calls
and decode steps, and the rotating order of repetitions.

Imports nothing heavy at module level (torch, transformers and the repo's packages only inside the
helpers), so the GPU check can use it on a machine without TRL or W&B."""
from __future__ import annotations

import time

import common  # noqa: F401  (puts the repo on sys.path for the helpers' imports)

# SmolLM2-135M's and a tiny Llama's shape (transformers LlamaConfig fields), for random-weight models: step
# time does not depend on the weights' values
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def hf_model(model: str, dtype, device: str = "cpu", **tokenizer_kw):
    """(tokenizer, transformers model in eval mode on `device`) of `model`: a local directory, a hub id or the
    embedded alias; tokenizer_kw go to AutoTokenizer (e.g. padding_side="left" to batch prompts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.runtime.model.fetch import fetch_model

    path = fetch_model(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return AutoTokenizer.from_pretrained(path, **tokenizer_kw), hf


def tokenizer_and_eos(model: str, dtype: str = "bfloat16"):
    """The tokenizer and EOS ids RolloutEngine.from_pretrained uses for `model`, for engines built from
    loaded weights (the engine that found them is dropped)."""
    from rollout.engine import RolloutEngine

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


def sync(device) -> None:
    """Wait for queued GPU work, so wall-clock time covers it (a no-op on CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(fn, device):
    """(fn(), seconds) of one call, the device's queued work waited for before and after."""
    sync(device)
    t0 = time.perf_counter()
    value = fn()
    sync(device)
    return value, time.perf_counter() - t0


def time_steps(run, tokens, start, iters: int, device, warmup: int = 2) -> float:
    """Seconds per `run(tokens, start)` after `warmup` untimed calls (they capture, for a graph pool)."""
    for _ in range(warmup):
        run(tokens, start)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        run(tokens, start)
    sync(device)
    return (time.perf_counter() - t0) / iters


def release_cached(device) -> None:
    """Hand the CUDA caching allocator's free blocks back between models (a no-op on CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def rotation(items: list, k: int) -> list:
    """`items` starting at position k (mod their count): repetition k measures them in this order, so a
    machine that drifts during a repetition does not always favour the same one."""
    return items[k % len(items):] + items[:k % len(items)]
