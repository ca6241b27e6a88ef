"""The `spec_costs` section: what speculation costs on this device, the inputs of the speedup formula
(docs/gpu.md#predicted-rollout-speedup), in this order:

  * drafting: one EAGLE-3 draft level for the whole batch, ms and over the plain step at that batch (the
    engine's own rollout/draft_level_ms and rollout/draft_cost), a random-weight drafter forced on every step of
    a rollout (its cost does not depend on its weights), its proposals replayed from graphs where there are any;
    and those graphs replayed alone (`graphs_ms`, `graphs_share` of the proposal's time): the device's part;
  * verify: one target step over T tokens a row (the pending token and T - 1 drafts; a chain, or a binary tree
    of T nodes), per batch bucket, replayed from the CUDA graph pool (a graph per T: no padding to a power of
    two), relative to a plain (T = 1) step of the same bucket at the same context; the median of three timings.
"""
from __future__ import annotations

import traceback

from rlspec.bench.gpucheck.common import build_hf, engine_over, fits, median_time, random_prompts, release, timed_calls

DEPTH = 4  # the EAGLE-3 rows' draft levels a proposal


def tree(T: int):
    """depths [T] and mask [T, T] of a binary tree of T nodes in heap order (node 0: the pending token; node i's
    parent (i - 1) // 2): node t sees itself and its ancestors."""
    import torch

    parent = [-1] + [(i - 1) // 2 for i in range(1, T)]
    depth, mask = [0] * T, torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
        depth[i] = depth[parent[i]] + 1 if i else 0
    return torch.tensor(depth), mask


def verify_rows(model, device, dtype, cfg: dict, left) -> list[dict]:
    """Step ms per (batch, shape, T) and its ratio to the plain step of that batch; a runner of its own over
    `model` (its own KV pool and graphs), every row at cfg["ctx"] cached positions."""
    import torch

    from rlspec.rollout.runtime.runner import ModelRunner

    top = max(cfg["verify_tokens"])
    runner = ModelRunner(model, device, dtype, graph_mode="lazy", max_graph_t=top, compile_mode="off")
    B = max(cfg["batches"])
    cache = runner.ensure_cache(B, cfg["ctx"] + top + 8)
    cache.grow([(b, ("spec_costs", b), cfg["ctx"] + top) for b in range(B)])
    runner.warm(sorted({1, *cfg["verify_tokens"], *cfg["tree_tokens"]}), B)  # a graph per token count
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in cfg["batches"]:
        start = torch.full((b,), cfg["ctx"])
        shapes = [("chain", 1)] + [("chain", T) for T in cfg["verify_tokens"]] + \
            [("tree", T) for T in cfg["tree_tokens"]]
        for kind, T in shapes:
            if left() <= 0:
                return rows
            tokens = torch.randint(3, model.cfg.vocab_size, (b, T), generator=g)
            extra = {}
            if kind == "tree":
                depths, mask = tree(T)
                extra = dict(depths=depths.expand(b, T).clone(), tree_mask=mask.expand(b, T, T).clone())
            secs, all_s = median_time(lambda: runner.step(tokens, start, **extra), cfg["iters"], device,
                                      cfg["repeats"])
            rows.append(dict(batch=b, kind=kind, tokens=T, step_ms=secs * 1e3, step_ms_all=[t * 1e3 for t in all_s]))
        plain = rows[-len(shapes)]["step_ms"]
        for r in rows[-len(shapes):]:
            r["vs_plain"] = r["step_ms"] / plain
        print(f"  batch {b}: plain {plain:.2f} ms; " + ", ".join(
            f"{r['kind']} {r['tokens']} x{r['vs_plain']:.2f}" for r in rows[-len(shapes) + 1:]), flush=True)
    runner.release()
    return rows


def draft_rows(hf, device, dtype, cfg: dict, left, graph_mode: str = "auto") -> list[dict]:
    """One EAGLE-3 draft level for the whole batch, ms and over the plain step, per batch, the drafter forced
    on every step (4 drafts a step); graph_mode: the drafter's ("emulate" in the rehearsal: the graph path's
    bookkeeping on a CPU)."""
    from rlspec.rollout import metrics as M
    from rlspec.rollout.types import SamplingParams, SpecConfig

    spec = SpecConfig(drafter="eagle3", num_draft_tokens=DEPTH, selector="always", online_training=False)
    new = cfg["draft_new_tokens"]
    engine = engine_over(hf, device, dtype, max(cfg["draft_batches"]), cfg["prompt_len"] + new + 16, spec=spec)
    engine.speculation.learned.graph_mode = graph_mode
    engine.speculation.learned.early = True  # the CUDA path in the rehearsal too
    prompts = random_prompts(max(cfg["draft_batches"]), cfg["prompt_len"], hf.config.vocab_size, seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)
    rows = []
    for b in cfg["draft_batches"]:
        if left() <= 0:
            break
        # the warm-up right before its timed call: the drafter keeps its level graphs for the MAX_FRAMES most recent
        # (row, context) frames, so the warm-ups of the other batches would evict this one's (the 2026-11-30 run
        # captured 4 and 6 graphs inside the timed calls of batch 1 and 8, warmed up before batch 32's)
        engine.generate(prompts[:b], params)
        call = timed_calls(engine, lambda: engine.generate(prompts[:b], params), device, 1)
        stats = call["stats"]  # ignore_eos: the live batch stays b for the whole call
        rows.append(dict(batch=b, draft_level_ms=stats.get(f"{M.DRAFT_LEVEL_MS}/eagle3"),
                         draft_cost=stats.get(f"{M.DRAFT_COST}/eagle3"),
                         draft_ms_per_token=stats.get(f"{M.DRAFT_MS_PER_TOKEN}/eagle3"),
                         plain_step_ms=stats.get(M.PLAIN_STEP_MS), rollout_s=call["seconds"],
                         timed_captures=call["timed_captures"], timed_compiles=call["timed_compiles"],
                         **proposal_graphs_ms(engine.speculation.learned.level_graphs(), DEPTH, device)))
        print(f"  eagle3 batch {b}: a level {rows[-1]['draft_level_ms']} ms, {rows[-1]['draft_cost']} of a plain "
              f"step; the proposal's graphs alone {rows[-1]['graphs_ms']} ms", flush=True)
    rows_graphs = engine.speculation.learned.level_graphs()
    for r in rows:
        r["level_graphs"] = None if rows_graphs is None else dict(rows_graphs.counts)
    del engine
    return rows


def proposal_graphs_ms(graphs, depth: int, device, iters: int = 10) -> dict:
    """The device's own time for the graphs of the latest proposal (its catch-up's and its `depth` levels', the
    most recently used keys), each replayed `iters` times back to back (the device never waits for the host's
    launch of the next): ms a replay of each, and their sum, a proposal's graphs without the host's work between
    them. Against the rollout's draft_level_ms x depth, what is left is the host's (empty where the levels run
    eagerly)."""
    if graphs is None or not graphs.catch_ups or not graphs.frames:
        return {}
    frame = next(reversed(graphs.frames))  # (r, s, c)
    levels = [k for k in graphs.graphs.graphs if k[:3] == frame]
    sig = levels[-1][4]
    keys = [next(reversed(graphs.catch_ups))] + [k for k in levels if k[4] == sig][-depth:]
    each = {str(k[:4]): median_time(graphs.graphs.graphs[k].replay, iters, device, 1)[0] * 1e3 for k in keys}
    return {"graphs_ms": sum(each.values()), "graph_ms_each": each}


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, batches, verify_tokens, tree_tokens, ctx, iters, draft_batches, draft_new_tokens, prompt_len."""
    out = {"shape": cfg["shape"], "ctx": cfg["ctx"], "verify": [], "eagle3_draft": []}
    why = fits(cfg["shape"], max(cfg["batches"]), cfg["ctx"] + 16, 2, device, dtype)
    if why:
        return {**out, "skipped": why}
    from rlspec.rollout.runtime.model import loader

    hf = build_hf(cfg["shape"], dtype, device)
    # the drafter's rows first: the 2026-11-30 run spent the section's time on the verify rows and never drafted
    print(f"spec_costs {cfg['shape']}: EAGLE-3 drafting", flush=True)
    try:
        out["eagle3_draft"] = draft_rows(hf, device, dtype, cfg, left, "emulate" if device.type == "cpu" else "auto")
    except Exception as e:  # a drafter failing here must not cost the verify rows, the oracle's formula inputs
        traceback.print_exc()
        out["eagle3_error"] = f"{type(e).__name__}: {e}"
    save(out)
    release(device)
    model = loader.from_hf_model(hf, dtype, device)
    print(f"spec_costs {cfg['shape']}: verify steps", flush=True)
    out["verify"] = verify_rows(model, device, dtype, cfg, left)
    del model
    plain = {r["batch"]: r["step_ms"] for r in out["verify"] if r["tokens"] == 1}
    for r in out["eagle3_draft"]:  # a level over the graph-replayed plain step of the verify rows
        if r["draft_level_ms"] is not None and r["batch"] in plain:
            r["vs_plain_step"] = r["draft_level_ms"] / plain[r["batch"]]
        if r["draft_level_ms"] and r.get("graphs_ms") is not None:  # the rest of a proposal is the host's
            r["graphs_share"] = r["graphs_ms"] / (r["draft_level_ms"] * DEPTH)
    from rlspec.rollout.runtime.model.fused_ops import product_choices

    out["products"] = product_choices()  # the verifies' and the drafter's: other row buckets than `plain`'s
    save(out)
    if "eagle3_error" in out:  # the rows are saved; the section still fails, so the report says so
        raise RuntimeError(f"EAGLE-3 drafting failed: {out['eagle3_error']}")
    return out
