"""The `compiled` section (an extra: `--sections compiled`, outside the default check's 600 s): the plain decode
step replayed from the graph pool with the decoder layer as it runs by default on CUDA (eager layers: ~30 small
kernels each for the norms, rotary embedding, residuals and activation) and compiled by Inductor (`compile_mode="on"`:
runtime/compiled.py, those fused), 7B shape, per batch, at one context. Whether compiling pays on CUDA is what
decides `compile_mode="auto"` there (docs/gpu.md#where-a-step-goes). Per row: both step times (median of three
timings), the seconds the first compiled step took (compile + capture), and the largest logit difference between
the two (the same product summed in another order)."""
from __future__ import annotations

import time

from rlspec.bench.gpucheck.common import build_hf, fits, median_time, release, sync


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, batches, context, iters, repeats."""
    import torch

    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.runtime.runner import ModelRunner

    out = {"shape": cfg["shape"], "context": cfg["context"], "rows": []}
    B, ctx = max(cfg["batches"]), cfg["context"]
    why = fits(cfg["shape"], B, ctx + 16, 1, device, dtype)
    if why:
        return {**out, "skipped": why}
    model = loader.from_hf_model(build_hf(cfg["shape"], dtype, device), dtype, device)
    release(device)
    runners = {}
    for mode in ("off", "on"):
        runner = ModelRunner(model, device, dtype, graph_mode="lazy", max_graph_t=1, compile_mode=mode)
        runner.ensure_cache(B, ctx + 16).grow([(b, ("compiled", b), ctx + 1) for b in range(B)])
        runners[mode] = runner
    g = torch.Generator().manual_seed(0)
    for b in cfg["batches"]:
        if left() <= 0:
            break
        tokens, start = torch.randint(3, model.cfg.vocab_size, (b, 1), generator=g), torch.full((b,), ctx)
        row = {"batch": b}
        for mode, runner in runners.items():
            t0 = time.perf_counter()
            logits, _ = runner.step(tokens, start)  # the first step: compile (once) and capture this bucket
            sync(device)
            row[f"first_step_s_{mode}"] = time.perf_counter() - t0
            row[f"logits_{mode}"] = logits[:, -1].float().clone()
            secs, all_s = median_time(lambda: runner.step(tokens, start), cfg["iters"], device, cfg["repeats"])
            row[f"step_ms_{mode}"], row[f"step_ms_all_{mode}"] = secs * 1e3, [t * 1e3 for t in all_s]
        row["max_logit_diff"] = float((row.pop("logits_on") - row.pop("logits_off")).abs().max())
        row["speedup"] = row["step_ms_off"] / row["step_ms_on"]
        out["rows"].append(row)
        print(f"  batch {b}: eager layers {row['step_ms_off']:.2f} ms, compiled {row['step_ms_on']:.2f} ms "
              f"(x{row['speedup']:.2f}; first compiled step {row['first_step_s_on']:.1f} s), max logit diff "
              f"{row['max_logit_diff']:.3g}", flush=True)
        save(out)
    for runner in runners.values():
        runner.release()
    return out
