"""The workers' engine metrics merged into one dict with the engine's names (what trainers log).

Counts (decode steps, strategy/reason/<stage> steps, ...) and seconds saved add up across workers (each worker's
rollout/spec_saved_s is its own decode time saved), peaks take the largest, and rates are averaged weighted by each
worker's share of the samples (a worker that ran one short task should not weigh as much as one
that ran ten). Throughput is the pool's: tokens of every worker over the wall time of the calls
(rollout/time_s), with each worker's own busy time kept as rollout/worker_busy_s.
"""
from __future__ import annotations

import rlspec.rollout.metrics as M

SUMMED = (M.GENERATED_TOKENS, M.NUM_SEQUENCES, M.DECODE_STEPS, M.PREEMPTIONS,
          M.KV_SHARED_BLOCKS, M.SPEC_SAVED_S, "drafter/shipped_samples", "drafter/shipped_tokens")
SUMMED_PREFIXES = ("strategy/reason/",)  # steps each decision stage settled: counts
PEAKS = (M.MAX_LEN, M.KV_BLOCKS_USED, M.KV_CACHE_MB, M.KV_BLOCKS_TOTAL,
         M.GRAPH_POOL_MB, M.POLICY_VERSION)


def merge_stats(per_worker: list[dict[str, float]], wall_s: float) -> dict[str, float]:
    """per_worker: each worker engine's stats() since the last call; wall_s: the pool's generate time."""
    weights = [w.get(M.NUM_SEQUENCES, 0.0) for w in per_worker]
    keys = sorted({k for w in per_worker for k in w})
    out: dict[str, float] = {}
    for k in keys:
        vals = [(w[k], wt) for w, wt in zip(per_worker, weights) if k in w]
        if k in SUMMED or k.startswith(SUMMED_PREFIXES):
            out[k] = sum(v for v, _ in vals)
        elif k in PEAKS:
            out[k] = max(v for v, _ in vals)
        else:
            share = sum(wt for _, wt in vals)
            out[k] = sum(v * wt for v, wt in vals) / share if share else sum(v for v, _ in vals) / len(vals)
    busy = [w.get(M.TIME_S, 0.0) for w in per_worker]
    out["rollout/worker_busy_s"] = sum(busy)
    out[M.TIME_S] = wall_s
    out[M.TOKENS_PER_S] = out.get(M.GENERATED_TOKENS, 0.0) / wall_s if wall_s > 0 else 0.0
    # how evenly the tail spread: 1.0 = every worker busy for the whole call
    out["workers/busy_share"] = sum(busy) / (len(per_worker) * wall_s) if wall_s > 0 and per_worker else 0.0
    return out
