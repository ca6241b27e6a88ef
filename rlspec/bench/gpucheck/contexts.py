"""The `contexts` section: the plain decode step at long contexts (7B shape: 256, 2k and 8k cached positions,
batch 1/8/32), replayed from the graph pool, with the weights-plus-KV bandwidth limit beside each row: what the
paged decode attention reads at long contexts against what the memory allows. Each row names the kernel that
attended (`paged_kernel`: Triton's paged decode, FlexAttention, or dense off CUDA); `compare` times a few
(context, batch) rows again with the other kernel, for the choice of default (docs/gpu.md#paged-decode-attention)."""
from __future__ import annotations

from rlspec.bench.gpucheck.common import build_hf, fits, median_time, release
from rlspec.bench.gpucheck.plain import limit


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, batches, contexts, iters, repeats; compare: kernel, rows [(context, batch)] (optional)."""
    from rlspec.rollout.runtime.model import attention, loader

    out = {"shape": cfg["shape"], "rows": []}
    B, top = max(cfg["batches"]), max(cfg["contexts"])
    why = fits(cfg["shape"], B, top + 16, 1, device, dtype)
    if why:
        return {**out, "skipped": why}
    model = loader.from_hf_model(build_hf(cfg["shape"], dtype, device), dtype, device)
    release(device)
    passes = [(attention.paged_kernel, [(c, b) for c in cfg["contexts"] for b in cfg["batches"]])]
    if cfg.get("compare"):
        passes.append((cfg["compare"]["kernel"], [tuple(r) for r in cfg["compare"]["rows"]]))
    default = attention.paged_kernel
    try:
        for kernel, rows in passes:
            attention.paged_kernel = kernel
            if not _time_rows(model, rows, cfg, device, dtype, out, left, save):
                break
    finally:
        attention.paged_kernel = default
    save(out)
    return out


def _time_rows(model, rows, cfg, device, dtype, out, left, save) -> bool:
    """One runner (its graphs attend with attention.paged_kernel) over rows [(context, batch)]; False once the time
    is up."""
    import torch

    from rlspec.rollout.runtime.model import attention
    from rlspec.rollout.runtime.runner import ModelRunner

    served = ("triton" if attention.use_paged_decode(device) else "flex" if attention.use_flex(device)
              else "dense")
    B, top = max(b for _, b in rows), max(c for c, _ in rows)
    runner = ModelRunner(model, device, dtype, graph_mode="lazy", max_graph_t=1, compile_mode="off")
    cache = runner.ensure_cache(B, top + 16)
    cache.grow([(b, ("contexts", b), top + 1) for b in range(B)])
    g = torch.Generator().manual_seed(0)
    try:
        for ctx, b in rows:
            if left() <= 0:
                return False
            tokens, start = torch.randint(3, model.cfg.vocab_size, (b, 1), generator=g), torch.full((b,), ctx)
            secs, all_s = median_time(lambda: runner.step(tokens, start), cfg["iters"], device, cfg["repeats"])
            bound = limit(model, b, ctx + 1, device)
            out["rows"].append(dict(kernel=served, context=ctx, batch=b, step_ms=secs * 1e3,
                                    step_ms_all=[t * 1e3 for t in all_s], **bound,
                                    over_limit=secs * 1e3 / bound["limit_ms"] if bound["limit_ms"] else None))
            print(f"  {served} context {ctx} batch {b}: {secs * 1e3:.2f} ms (limit {bound['limit_ms']})", flush=True)
            save(out)
    finally:
        runner.release()
    return True
