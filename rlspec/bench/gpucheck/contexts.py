"""The `contexts` section: the plain decode step at long contexts (7B shape: 256, 2k and 8k cached positions,
batch 1/8/32), replayed from the graph pool, with the weights-plus-KV bandwidth limit beside each row: what the
paged decode attention reads at long contexts against what the memory allows. Each row names the kernel that
attended (`paged_kernel`: Triton's paged decode, FlexAttention, or dense off CUDA) and whether our kernels launched
with programmatic dependent launch (`pdl`, model/pdl.py); `compare` times a few (context, batch) rows again with the
other kernel, for the choice of default (docs/gpu.md#paged-decode-attention), and `without_pdl` a few with our
kernels launched without PDL (its gain, measured).
`lookup` times the device n-gram drafter's lookup alone at a few (rows, group, context) shapes, and `draw` a plain
step's draw (its Triton kernels against torch's ops) at a few batches of Qwen2.5's vocabulary.
`attention` times the Triton kernel alone over one layer's pool, at its default launch and at the others listed
(keys a tile, pipeline stages, programs an SM): the KV it reads a second against the memory's bandwidth, the
figure each default is set from."""
from __future__ import annotations

import os
import statistics

from rlspec.bench.gpucheck.common import SHAPES, build_hf, fits, median_time, pdl_module, release, timed
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
    pdl = pdl_module()
    default, dependent = attention.paged_kernel, pdl.enabled if pdl else False
    passes = [(default, dependent, [(c, b) for c in cfg["contexts"] for b in cfg["batches"]])]
    if cfg.get("compare"):
        passes.append((cfg["compare"]["kernel"], dependent, [tuple(r) for r in cfg["compare"]["rows"]]))
    if cfg.get("without_pdl") and pdl:
        passes.append((default, False, [tuple(r) for r in cfg["without_pdl"]]))
    try:
        for kernel, with_pdl, rows in passes:
            attention.paged_kernel = kernel
            if pdl:
                pdl.enabled = with_pdl
            if not _time_rows(model, rows, cfg, device, dtype, out, left, save):
                break
    finally:
        attention.paged_kernel = default
        if pdl:
            pdl.enabled = dependent
    del model
    release(device)
    if cfg.get("attention"):
        out["attention"] = attention_rows(cfg["shape"], cfg["attention"], device, dtype, left, save, out)
    if cfg.get("lookup"):
        out["lookup"] = lookup_rows(cfg["lookup"], device, left, save, out)
    if cfg.get("draw"):
        out["draw"] = draw_rows(cfg["draw"], device, left, save, out)
    save(out)
    return out


def lookup_rows(cfg: dict, device, left, save, out) -> list[dict]:
    """The device n-gram drafter's lookup alone (drafters/ngram_device.py) at rows [(rows, group, context)]: 4-token
    drafts over texts of random tokens, in microseconds (on CUDA as a step meets it: fused_ops._seconds), beside a
    plain 7B step's few milliseconds: what drafting on the device costs it."""
    import torch

    from rlspec.rollout.speculation.drafters.ngram_device import lookup

    rows = []
    g = torch.Generator().manual_seed(0)
    for B, G, L in cfg["rows"]:
        if left() <= 0:
            break
        docs = torch.randint(3, 1000, (B, G, L), generator=g, dtype=torch.int32).to(device)
        lens = torch.randint(L // 2, L + 1, (B, G), generator=g).to(device)
        own = torch.zeros(B, dtype=torch.long, device=device)
        secs = _kernel_seconds(lambda: lookup(docs, lens, own, 4, 4), device)
        rows.append(dict(rows=B, group=G, context=L, us=secs * 1e6))
        print(f"  ngram_device lookup, {B} rows x {G} texts x {L} positions: {secs * 1e6:.1f} us", flush=True)
        save({**out, "lookup": rows})
        del docs
    return rows


def _without_triton(device, what: str) -> dict | None:
    """Why our Triton kernels cannot be timed here ({"skipped": ...}), or None: on a CPU they run only in Triton's
    interpreter."""
    from rlspec.rollout.runtime.model.attention import triton_available

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": f"{what} on a CPU only in Triton's interpreter (TRITON_INTERPRET=1)"}
    return None if triton_available() else {"skipped": "Triton is not installed"}


def draw_rows(cfg: dict, device, left, save, out) -> list[dict] | dict:
    """A plain step's draw from softmax(logits / T) with its logprob and finite column at batches cfg["rows"] of a
    cfg["vocab"] vocabulary: model/sample_rows.py's two kernels against sampling.torch_sample_rows (what the engine
    ran before them, and runs where they do not serve), microseconds each (docs/gpu.md#the-draw)."""
    import torch

    from rlspec.rollout.runtime import sampling

    skipped = _without_triton(device, "the kernels run")
    if skipped:
        return skipped
    from rlspec.rollout.runtime.model.sample_rows import sample_rows

    rows = []
    g = torch.Generator().manual_seed(0)
    for B in cfg["rows"]:
        if left() <= 0:
            break
        x = (torch.randn(B, cfg["vocab"], generator=g) * 3).to(device)
        r = torch.rand(B, generator=g).to(device)
        us = {name: _kernel_seconds(lambda fn=fn: fn(x, r, 0.8), device) * 1e6
              for name, fn in (("triton_us", sample_rows), ("torch_us", sampling.torch_sample_rows))}
        rows.append(dict(batch=B, vocab=cfg["vocab"], **us, gain=us["torch_us"] / us["triton_us"]))
        print(f"  draw, batch {B} x {cfg['vocab']}: kernels {us['triton_us']:.1f} us, torch {us['torch_us']:.1f} us",
              flush=True)
        save({**out, "draw": rows})
    return rows


def attention_rows(shape: str, cfg: dict, device, dtype, left, save, out) -> list[dict] | dict:
    """The paged kernel alone at rows [(context, batch)] of `shape`'s heads, over a pool of 128-position blocks
    shuffled across rows, at its default launch then each of cfg["launches"] [keys, stages, per_sm]: microseconds
    (cold L2 on CUDA: fused_ops._seconds), the splits it ran, and the KV bytes read a second against the device's
    bandwidth. On a CPU only where Triton's interpreter is on (make gpu-rehearsal), at tiny shapes."""
    import torch

    from rlspec.bench.gpucheck.presets import hbm_bytes_s

    skipped = _without_triton(device, "the kernel runs")
    if skipped:
        return skipped
    from rlspec.rollout.runtime.model import paged_decode

    fields = SHAPES[shape][1]
    H, KV = fields["num_attention_heads"], fields["num_key_value_heads"]
    D, BS = fields["hidden_size"] // H, 128
    bw = hbm_bytes_s(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    default = [None, paged_decode.STAGES, paged_decode.PER_SM]
    rows = []
    g = torch.Generator().manual_seed(0)
    for ctx, B in cfg["rows"]:
        n = -(-(ctx + 1) // BS)
        table = torch.randperm(B * n + 1, generator=g)[: B * n].view(B, n).to(device)
        k_pool, v_pool = torch.randn(2, B * n + 1, BS, KV, D, device=device, dtype=dtype)  # 1 GB at 8k x 32
        q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
        start = torch.full((B,), ctx, device=device)
        kv_bytes = 2 * B * (ctx + 1) * KV * D * k_pool.element_size()
        for keys, stages, per_sm in [default, *cfg["launches"]]:
            if left() <= 0:
                return rows
            row = dict(context=ctx, batch=B, keys=keys or paged_decode.tile_keys(16, D, k_pool.element_size(), BS),
                       stages=stages, per_sm=per_sm, default=[keys, stages, per_sm] == default)
            row["splits"] = paged_decode.splits(B, KV, n * BS, device, row["keys"], per_sm)
            try:
                secs = _kernel_seconds(lambda: paged_decode.paged_decode(q, k_pool, v_pool, table, start, None,
                                                                        keys=keys, stages=stages, per_sm=per_sm),
                                       device)
            except Exception as exc:  # a launch this Triton cannot compile: the row says so, the others go on
                rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            row.update(us=secs * 1e6, kv_tb_s=kv_bytes / secs / 1e12, of_hbm=kv_bytes / secs / bw if bw else None)
            rows.append(row)
            print(f"  attention ctx {ctx} batch {B} keys {row['keys']} stages {stages} per_sm {per_sm}: "
                  f"{secs * 1e6:.1f} us, {row['kv_tb_s']:.2f} TB/s" + (f" ({row['of_hbm']:.0%})" if bw else ""),
                  flush=True)
            save({**out, "attention": rows})
        del k_pool, v_pool
        release(device)
    return rows


def _kernel_seconds(fn, device) -> float:
    """One fn() in seconds: on CUDA as a step meets it (fused_ops._seconds: the cache cold, no launch in it);
    elsewhere the median of three by the device's timer."""
    if device.type == "cuda":
        from rlspec.rollout.runtime.model.fused_ops import _seconds

        return _seconds(fn)
    return statistics.median(timed(fn, device)[1] for _ in range(3))


def _time_rows(model, rows, cfg, device, dtype, out, left, save) -> bool:
    """One runner (its graphs attend with attention.paged_kernel) over rows [(context, batch)]; False once the time
    is up."""
    import torch

    from rlspec.rollout.runtime.model import attention
    from rlspec.rollout.runtime.runner import ModelRunner

    served = ("triton" if attention.use_paged_decode(device) else "flex" if attention.use_flex(device)
              else "dense")
    pdl = pdl_module()
    dependent = bool(pdl and pdl.serves(torch.empty(0, device=device, dtype=dtype)))  # runs its self-test once
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
            out["rows"].append(dict(kernel=served, pdl=dependent, context=ctx, batch=b, step_ms=secs * 1e3,
                                    step_ms_all=[t * 1e3 for t in all_s], **bound,
                                    over_limit=secs * 1e3 / bound["limit_ms"] if bound["limit_ms"] else None))
            print(f"  {served}{'' if dependent else ' (no PDL)'} context {ctx} batch {b}: {secs * 1e3:.2f} ms "
                  f"(limit {bound['limit_ms']})", flush=True)
            save(out)
    finally:
        runner.release()
    return True
