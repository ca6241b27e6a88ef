"""The `plain` section: plain decoding, the engine against transformers' `generate`, per model shape and batch.

Per row (greedy, EOS ignored, the same random prompts): transformers' tok/s; the engine's tok/s with its CUDA
graphs already captured; the decode step at the rollout's mean context, eager and replayed from the graph
pool; the step's achieved bandwidth (weights + KV read / step time). A shape that would not fit says why."""
from __future__ import annotations

from rlspec.bench.gpucheck.common import build_hf, engine_over, fits, random_prompts, release, time_steps, timed


def hf_tok_s(hf, prompts, batches: list[int], new: int, device) -> dict[int, float]:
    """transformers' generate, tokens/s per batch (greedy, `new` tokens each, after a short warm-up call)."""
    import torch

    def gen(b, n):
        ids = torch.tensor(prompts[:b], device=device)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)

    gen(1, 2)
    return {b: b * new / timed(lambda b=b: gen(b, new), device)[1] for b in batches}


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: each parameter once; an untied embedding table not at all (a
    step gathers B of its rows)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or (name.endswith("embed_tokens.weight") and not model.cfg.tie_word_embeddings):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def engine_rows(engine, prompts, batches: list[int], new: int, device, iters: int, left) -> list[dict]:
    """Engine tok/s and step times per batch, while `left()` (seconds of the section's budget) is positive."""
    import torch

    from rlspec.rollout.runtime.graphs import EagerRunner
    from rlspec.rollout.types import SamplingParams

    full = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts, full)  # the pool for every row at the timed length: no timed call meets a new one
    ctx = len(prompts[0]) + new // 2
    rows = []
    for b in batches:
        if left() <= 0:
            break
        ids = prompts[:b]
        engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))  # capture b's graph
        secs = timed(lambda: engine.generate(ids, full), device)[1]
        runner = engine.runner
        tokens, start = torch.tensor(ids)[:, :1], torch.full((b,), ctx)
        graph_s = time_steps(lambda: runner.steps.run(tokens, start), iters, device)
        eager = EagerRunner(runner.model, runner.cache, device)
        eager_s = time_steps(lambda: eager.run(tokens, start), max(iters // 4, 2), device, warmup=1)
        moved = weight_bytes(runner.model) + kv_read(runner.model, b, ctx + 1)
        rows.append(dict(batch=b, engine_tok_s=b * new / secs, step_graph_ms=graph_s * 1e3,
                         step_eager_ms=eager_s * 1e3, graph_speedup=eager_s / graph_s,
                         achieved_gbs=moved / graph_s / 1e9))
        print(f"  batch {b}: engine {rows[-1]['engine_tok_s']:.0f} tok/s, graph step {graph_s * 1e3:.2f} ms, "
              f"eager {eager_s * 1e3:.2f} ms", flush=True)
    return rows


def kv_read(model, rows: int, context: int) -> int:
    """K and V bytes a step reads: `context` positions of `rows` rows over all layers."""
    c = model.cfg
    p = next(model.parameters())
    return 2 * rows * context * c.num_layers * c.num_kv_heads * c.head_dim * p.element_size()


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shapes, batches, prompt_len, new_tokens {shape: n}, iters. save(partial) after every shape."""
    out = {"rows": [], "skipped": {}}
    for shape in cfg["shapes"]:
        new = cfg["new_tokens"][shape]
        length = cfg["prompt_len"] + new + 8
        why = "time budget spent" if left() <= 0 else fits(shape, max(cfg["batches"]), length, 2, device, dtype)
        if why:
            out["skipped"][shape] = why
            save(out)
            continue
        print(f"plain {shape}: transformers generate", flush=True)
        hf = build_hf(shape, dtype, device)
        prompts = random_prompts(max(cfg["batches"]), cfg["prompt_len"], hf.config.vocab_size)
        hf_rows = hf_tok_s(hf, prompts, cfg["batches"], new, device)
        print(f"plain {shape}: engine", flush=True)
        engine = engine_over(hf, device, dtype, max(cfg["batches"]), length)
        del hf
        release(device)
        for r in engine_rows(engine, prompts, cfg["batches"], new, device, cfg["iters"], left):
            out["rows"].append(dict(model=shape, new_tokens=new, hf_tok_s=hf_rows[r["batch"]],
                                    speedup_vs_hf=r["engine_tok_s"] / hf_rows[r["batch"]], **r))
        del engine
        release(device)
        save(out)
    return out
