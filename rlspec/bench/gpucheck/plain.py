"""The `plain` section: plain decoding, the engine against transformers' `generate`, per model shape and batch.

Per row (greedy, EOS ignored, the same random prompts): the engine's tok/s over whole rollouts, every graph key
captured beforehand (a warm-up call per batch; captures and decode steps of each timed call are recorded and a
timed call that captured is flagged), the median of three; the decode step at the rollout's mean context, eager
and replayed from the graph pool (median of three timings); the step's bandwidth limit (weights + KV read at the
device's memory bandwidth) beside it; transformers' tok/s at a few batches. A shape that would not fit says why."""
from __future__ import annotations

import statistics

from rlspec.bench.gpucheck.common import (build_hf, engine_over, fits, median_time, pdl_module, random_prompts,
                                         release, time_steps, timed, timed_calls)


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


def kv_read(model, rows: int, context: int) -> int:
    """K and V bytes a step reads: `context` positions of `rows` rows over all layers."""
    c = model.cfg
    p = next(model.parameters())
    return 2 * rows * context * c.num_layers * c.num_kv_heads * c.head_dim * p.element_size()


def limit(model, rows: int, context: int, device) -> dict:
    """The step's bandwidth limit: weights + KV bytes, and their read time at the device's memory bandwidth
    (limit_ms None where the bandwidth is not known: a CPU, a GPU not in presets.HBM_BYTES_S)."""
    from rlspec.bench.gpucheck.presets import hbm_bytes_s

    moved = weight_bytes(model) + kv_read(model, rows, context)
    bw = None
    if device.type == "cuda":
        import torch

        bw = hbm_bytes_s(torch.cuda.get_device_name(device))
    return dict(bytes_moved=moved, hbm_bytes_s=bw, limit_ms=moved / bw * 1e3 if bw else None)


def engine_rows(engine, prompts, batches: list[int], new: int, device, cfg: dict, left) -> list[dict]:
    """Engine tok/s and step times per batch, while `left()` (seconds of the section's budget) is positive."""
    import torch

    from rlspec.rollout.runtime.graphs import EagerRunner
    from rlspec.rollout.types import SamplingParams

    full = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts, full)  # the pool for every row at the timed length: no timed call meets a new one
    for b in batches:  # the warm-up: every batch's graph keys captured before any timing
        engine.generate(prompts[:b], full)
    ctx = len(prompts[0]) + new // 2
    rows = []
    for b in batches:
        if left() <= 0:
            break
        ids = prompts[:b]
        call = timed_calls(engine, lambda: engine.generate(ids, full), device, cfg["repeats"])
        runner = engine.runner
        tokens, start = torch.tensor(ids)[:, :1], torch.full((b,), ctx)
        graph_s, graph_all = median_time(lambda: runner.steps.run(tokens, start), cfg["iters"], device,
                                         cfg["repeats"])
        eager = EagerRunner(runner.model, runner.cache, device)
        eager_s = time_steps(lambda: eager.run(tokens, start), max(cfg["iters"] // 4, 2), device, warmup=1)
        bound = limit(runner.model, b, ctx + 1, device)
        # the engine's step: the call over its decode steps (its prefill included), against the graph step alone:
        # what the device waits for between steps (plain steps look ahead on CUDA: rollout/decode.py)
        engine_ms = call["seconds"] / statistics.median(call["decode_steps"]) * 1e3
        rows.append(dict(batch=b, context=ctx, engine_tok_s=b * new / call["seconds"], call_s=call["seconds_all"],
                         engine_step_ms=engine_ms, host_gap_ms=engine_ms - graph_s * 1e3,
                         decode_steps=call["decode_steps"], captures=call["captures"],
                         timed_captures=call["timed_captures"], timed_compiles=call["timed_compiles"],
                         step_graph_ms=graph_s * 1e3,
                         step_graph_ms_all=[t * 1e3 for t in graph_all], step_eager_ms=eager_s * 1e3,
                         graph_speedup=eager_s / graph_s, achieved_gbs=bound["bytes_moved"] / graph_s / 1e9,
                         **bound, of_limit=bound["limit_ms"] / (graph_s * 1e3) if bound["limit_ms"] else None))
        print(f"  batch {b}: engine {rows[-1]['engine_tok_s']:.0f} tok/s ({engine_ms:.2f} ms a step), graph step "
              f"{graph_s * 1e3:.2f} ms, eager {eager_s * 1e3:.2f} ms, captures / compiles in timed calls "
              f"{call['timed_captures']} / {call['timed_compiles']}", flush=True)
    return rows


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shapes, batches, prompt_len, new_tokens {shape: n}, iters, repeats, hf_batches. save(partial) after
    every shape."""
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
        hf_rows = hf_tok_s(hf, prompts, cfg["hf_batches"], new, device)
        print(f"plain {shape}: engine", flush=True)
        engine = engine_over(hf, device, dtype, max(cfg["batches"]), length)
        del hf
        release(device)
        for r in engine_rows(engine, prompts, cfg["batches"], new, device, cfg, left):
            hf_s = hf_rows.get(r["batch"])
            out["rows"].append(dict(model=shape, new_tokens=new, hf_tok_s=hf_s,
                                    speedup_vs_hf=r["engine_tok_s"] / hf_s if hf_s else None, **r))
        del engine
        release(device)
        save(out)
    from rlspec.rollout.runtime.model.fused_ops import product_choices

    out["products"] = product_choices()  # our few-rows kernel against cuBLAS, as the steps measured and chose
    pdl = pdl_module()
    out["pdl"] = pdl.status() if pdl else {}  # per device: our kernels launched with PDL
    return out
