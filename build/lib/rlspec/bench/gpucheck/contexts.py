"""The `contexts` section: the plain decode step at long contexts (7B shape: 256, 2k and 8k cached positions,
batch 1/8/32), replayed from the graph pool, with the weights-plus-KV bandwidth limit beside each row: what the
paged decode attention reads at long contexts against what the memory allows."""
from __future__ import annotations

from rlspec.bench.gpucheck.common import build_hf, fits, median_time, release
from rlspec.bench.gpucheck.plain import limit


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, batches, contexts, iters, repeats."""
    import torch

    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.runtime.runner import ModelRunner

    out = {"shape": cfg["shape"], "rows": []}
    B, top = max(cfg["batches"]), max(cfg["contexts"])
    why = fits(cfg["shape"], B, top + 16, 1, device, dtype)
    if why:
        return {**out, "skipped": why}
    model = loader.from_hf_model(build_hf(cfg["shape"], dtype, device), dtype, device)
    release(device)
    runner = ModelRunner(model, device, dtype, graph_mode="lazy", max_graph_t=1, compile_mode="off")
    cache = runner.ensure_cache(B, top + 16)
    cache.grow([(b, ("contexts", b), top + 1) for b in range(B)])
    g = torch.Generator().manual_seed(0)
    for ctx in cfg["contexts"]:
        for b in cfg["batches"]:
            if left() <= 0:
                save(out)
                return out
            tokens, start = torch.randint(3, model.cfg.vocab_size, (b, 1), generator=g), torch.full((b,), ctx)
            secs, all_s = median_time(lambda: runner.step(tokens, start), cfg["iters"], device, cfg["repeats"])
            bound = limit(model, b, ctx + 1, device)
            out["rows"].append(dict(context=ctx, batch=b, step_ms=secs * 1e3, step_ms_all=[t * 1e3 for t in all_s],
                                    **bound, over_limit=secs * 1e3 / bound["limit_ms"] if bound["limit_ms"] else None))
            print(f"  context {ctx} batch {b}: {secs * 1e3:.2f} ms (limit {bound['limit_ms']})", flush=True)
        save(out)
    runner.release()
    return out
