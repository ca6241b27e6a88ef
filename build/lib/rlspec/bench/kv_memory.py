"""KV memory of a GRPO rollout (`python -m rlspec.bench kv --part memory`): the paged cache against contiguous
rows, from the engine's own accounting. No forward runs.

The engine's own PagedKVCache (tensors on the "meta" device: shapes, no memory), BlockAllocator, KVBudget and
Scheduler (admission, preemption of the youngest, row moves) schedule a rollout whose completion lengths are drawn
up front from a GRPO-like law (lognormal body, a share running to the cap); each decode step emits
--tokens-per-step tokens per live sequence. The same loop with layout "contiguous" gives every admitted sequence
all the blocks of prompt + max_new_tokens at admission and shares nothing (one row of the longest length per
sequence) under the same budget.

Default shape: Qwen2.5-7B (28 layers, 4 KV heads, head dim 128, bf16: 56 KiB a token) plus one EAGLE-3 KV layer and
its staged target features (3 x 3584 bf16: 21 KiB a token; paged they are side buffers of the blocks, contiguous a
separate buffer for every sequence of the call); n=16 samples of 32 prompts (512 sequences), 8192 new tokens at
most, a 40 GiB budget.
"""
from __future__ import annotations

import math
import random
import time

from rlspec.bench import harness

QWEN7B = dict(num_layers=28, num_kv_heads=4, head_dim=128, hidden=3584)
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=16, hidden=64)


def model_config(shape: dict):
    from rlspec.rollout.runtime.model.config import ModelConfig

    return ModelConfig("qwen2", 152064, shape["hidden"], 18944, shape["num_layers"], 28, shape["num_kv_heads"],
                       shape["head_dim"], 1e-6, 32768, False, True, False, False, False)


def draw_lengths(args) -> list[tuple[int, int]]:
    """(prompt length, completion length) per sequence, prompt-major: most completions short, a lognormal
    body, --cap-share of them to the cap (GRPO on reasoning: a few samples ramble until cut)."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.prompts):
        plen = rng.randint(*args.prompt_len)
        for _ in range(args.n):
            body = int(rng.lognormvariate(math.log(args.median), args.sigma))
            out.append((plen, args.max_new_tokens if rng.random() < args.cap_share
                        else max(1, min(body, args.max_new_tokens - 1))))
    return out


def features_gib(cfg, sequences: int, positions: int) -> float:
    """Today's EAGLE-3 staging buffer: the target's features [sequences of the call, positions, 3H], bf16."""
    return sequences * positions * 3 * cfg.hidden_size * 2 / 2**30


def simulate(args, cfg, lengths, layout: str, budget_gb: float) -> dict:
    """Run the engine's scheduling with no forwards; returns the accounting. layout: paged | contiguous.
    Paged, an EAGLE-3 drafter's staged features are side buffers of the blocks (counted in the budget);
    contiguous, they are today's separate [sequences, positions, 3H] buffer, outside the KV budget."""
    import torch

    from rlspec.rollout.runtime.kv_budget import KVBudget
    from rlspec.rollout.runtime.kv_cache import PagedKVCache, block_bytes, side_bytes
    from rlspec.rollout.runtime.kv_ledger import KVLedger
    from rlspec.rollout.runtime.scheduler import Scheduler
    from rlspec.rollout.runtime.sequence import Sequence

    layers = cfg.num_layers + args.drafter_layers
    side = {"eagle3/features": ((3 * cfg.hidden_size,), torch.bfloat16)} \
        if args.drafter_layers and layout == "paged" else None
    bb = block_bytes(cfg, layers, args.block_size, torch.bfloat16) + side_bytes(side, args.block_size)
    longest = max(p + args.max_new_tokens for p, _ in lengths)
    rows = len(lengths)
    blocks = KVBudget(budget_gb, block_size=args.block_size).pool_blocks(bb, rows, longest, longest, "cpu")
    cache = PagedKVCache(cfg, rows, longest, blocks, args.block_size, torch.bfloat16, "meta", args.drafter_layers, side)
    seqs = [Sequence(i // args.n, i % args.n, [0] * p, args.max_new_tokens) for i, (p, _) in enumerate(lengths)]
    target = {id(s): c for s, (_, c) in zip(seqs, lengths)}
    sched = Scheduler([seqs[i:i + args.n] for i in range(0, rows, args.n)], rows, cache.alloc)
    if layout == "contiguous":  # a row of the longest length per sequence, taken at admission, nothing shared
        sched.group_blocks = lambda g: len(g) * cache.alloc.blocks_for(longest)
        sched.headroom = 0  # rows never grow
    kv = KVLedger(cache, sched)  # the engine's own block bookkeeping, step for step (RolloutEngine.generate)
    trace, steps = [], 0
    while sched.has_work:
        admitted = sched.admit()
        _admit(kv, admitted, layout, longest)
        for s in (s for g in admitted for s in g if not s.completion_ids):
            _emit(s, 1, target)  # the prefill samples each first token
        kv.retire()
        if not sched.live:
            continue
        kv.make_room()
        live = sched.live
        kept = kv.draft_room(live, [args.tokens_per_step - 1] * len(live))  # the step's extra tokens
        steps += 1
        for s, k in zip(live, kept):
            _emit(s, 1 + k, target)
        if layout == "paged":  # contiguous rows keep their length
            kv.trim(live)
        trace.append((steps, len(sched.live), cache.alloc.used))
        kv.retire()
    peak_blocks = max(u for _, _, u in trace)
    staging = features_gib(cfg, rows, longest) if args.drafter_layers and layout == "contiguous" else 0.0
    return dict(layout=layout, budget_gb=budget_gb, block_bytes=bb, pool_blocks=cache.alloc.capacity, decode_steps=steps,
                peak_kv_gib=peak_blocks * bb / 2**30, peak_blocks=peak_blocks, staging_gib=staging,
                peak_total_gib=peak_blocks * bb / 2**30 + staging,
                max_in_flight=max(n for _, n, _ in trace), mean_in_flight=sum(n for _, n, _ in trace) / len(trace),
                preemptions=sched.preemptions, shared_block_refs=cache.alloc.stats.shared_refs,
                trace=trace[:: max(1, len(trace) // 400)])


def _admit(kv, groups, layout: str, longest: int) -> None:
    """What RolloutEngine._prefill / _resume take: blocks for each prompt (shared by its samples when paged);
    contiguous, every sample's whole row of the longest length."""
    if layout == "contiguous":
        kv.cache.grow([(s.row, id(s), longest) for g in groups for s in g])
        return
    resumed = [g[0] for g in groups if g[0].resumed]
    fresh = [g for g in groups if not g[0].resumed]
    kv.resume_blocks(resumed)
    for s in resumed:
        s.resumed = False
    kv.prompt_blocks(fresh)
    kv.share_prompts(fresh)


def _emit(s, k: int, target: dict) -> None:
    n = min(k, target[id(s)] - len(s.completion_ids))
    s.completion_ids.extend([0] * n)
    if len(s.completion_ids) >= target[id(s)]:
        s.finish_reason = "length" if target[id(s)] >= s.max_new_tokens else "stop"


def run_memory(args) -> dict:
    import torch

    from rlspec.rollout.runtime.kv_cache import block_bytes

    if args.smoke:
        args.prompts, args.n, args.max_new_tokens, args.budget_gb = 4, 4, 256, 0.001
        args.prompt_len, args.median, args.tight_budget_gb = [8, 32], 40.0, 0.0004
    cfg = model_config(TINY if args.smoke else QWEN7B)
    lengths = draw_lengths(args)
    t0 = time.perf_counter()
    plan = [("paged", args.budget_gb), ("contiguous", args.budget_gb)]
    plan += [("paged", args.tight_budget_gb)] if args.tight_budget_gb > 0 else []
    runs = [simulate(args, cfg, lengths, layout, gb) for layout, gb in plan]
    per_token = block_bytes(cfg, cfg.num_layers + args.drafter_layers, 1, torch.bfloat16)
    longest = max(p + args.max_new_tokens for p, _ in lengths)
    comp = [c for _, c in lengths]
    return dict(
        part="memory",
        shape=dict(layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype="bfloat16",
                   drafter_layers=args.drafter_layers, kv_bytes_per_token=per_token),
        lengths=dict(sequences=len(lengths), mean_completion=sum(comp) / len(comp),
                     median_completion=sorted(comp)[len(comp) // 2],
                     at_cap=sum(c >= args.max_new_tokens for c in comp), tokens=sum(p + c for p, c in lengths)),
        # contiguous rows hold every sequence of the call as a row of the longest length at once
        contiguous_all_rows_gib=len(lengths) * longest * per_token / 2**30,
        # contiguous rows stage EAGLE-3's features in a [sequences, positions, 3H] buffer; paged, the features are
        # side buffers of the KV blocks (in peak_kv_gib of the paged runs)
        eagle3_stage_gib=features_gib(cfg, len(lengths), longest) if args.drafter_layers else 0.0,
        runs={f"{r['layout']}@{r['budget_gb']:g}GiB": r for r in runs},
        rows=[{k: v for k, v in r.items() if k != "trace"} for r in runs],
        columns=["layout", "budget_gb", "peak_kv_gib", "staging_gib", "peak_total_gib", "max_in_flight",
                 "mean_in_flight", "preemptions", "decode_steps", "shared_block_refs"],
        seconds=time.perf_counter() - t0)


def plot_memory(report: dict, path: str) -> None:
    harness.line_plot({name: [(s, n) for s, n, _ in r["trace"]] for name, r in report["runs"].items()}, "decode step",
                      "sequences in flight", "KV budget: paged vs contiguous rows", path)
