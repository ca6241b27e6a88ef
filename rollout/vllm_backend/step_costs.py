"""vLLM's own step costs and acceptance, measured in the running engine: what its depth table comes from.

vLLM speculates with a static per-batch-size depth (`num_speculative_tokens_per_batch_size`), which its
scheduler expands into a dense lookup `dynamic_sd_lookup[batch] -> depth` read at every step. In process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) that list is reachable, so rlspec can both measure vLLM's cost of a
step at each depth and install a new table whenever the drafter's acceptance moves.

cost(B, d): seconds of one vLLM engine step over B decoding requests drafting d tokens each, drafting
included (the EAGLE-3 head's d passes run inside the step). Timed with the lookup forced to d on B copies
of a short prompt (vLLM's prefix cache shares its prefill) at two lengths, the difference cancelling
prefill and per-call overhead:

    cost(B, d) = (wall(m2) - wall(m1)) / (steps(m2) - steps(m1)),

steps = verify steps per request, from vLLM's draft counter (drafts / B) when d > 0, m - 1 when d = 0.

Acceptance: vLLM counts accepted drafts per position; a = accepted at position 0 / drafts is the
per-token acceptance of the geometric model the engine's selectors use (docs/selectors.md); the
table for it is depth.py's (the fixed selector's gain per batch bucket) over these costs.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from rlspec.rollout.speculation.buckets import reachable_buckets
from rlspec.rollout.vllm_backend.depth import PRIOR_ACCEPTANCE, depth_table_from_costs
from rlspec.rollout.vllm_backend.spec_map import DepthTable
from rlspec.rollout.vllm_backend.weights import spec_counters


def scheduler(llm):
    """vLLM's scheduler, reachable only when the engine core runs in this process."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("vLLM's engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                           "(the vLLM backend does) to measure its step costs and update its depth table")
    return core.scheduler


def install(llm, table: DepthTable) -> None:
    """Make `table` vLLM's per-batch-size depth from the next step on (depths capped at the engine's k)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    sched = scheduler(llm)
    sched.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
        table.as_vllm(), vllm_max_batch_size=sched.scheduler_config.max_num_seqs,
        vllm_num_speculative_tokens=sched.num_spec_tokens)


@contextmanager
def forced_depth(llm, depth: int):
    """Every batch size drafts `depth` tokens inside the block (0 = no speculation)."""
    sched = scheduler(llm)
    saved = sched.dynamic_sd_lookup
    sched.dynamic_sd_lookup = [min(depth, sched.num_spec_tokens)] * (sched.scheduler_config.max_num_seqs + 1)
    try:
        yield
    finally:
        sched.dynamic_sd_lookup = saved


def acceptance(before: dict, after: dict) -> tuple[float | None, float]:
    """(per-token acceptance a, drafts it rests on) between two weights.spec_counters() readings; a is None
    without drafts."""
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0 or not after["per_pos"]:
        return None, 0.0
    first = after["per_pos"][0] - (before["per_pos"][0] if before["per_pos"] else 0.0)
    return first / drafts, drafts


def measure(llm, max_batch: int, depths: list[int], prompt: list[int], lengths: tuple[int, int] = (2, 8)
            ) -> dict[tuple[int, int], float]:
    """cost(B, d) in seconds at every batch bucket 1, 2, 4, ... <= max_batch (and max_batch) and each
    depth in `depths` (0 included). See the module docstring."""
    from vllm import SamplingParams

    batches = sorted({b for b in reachable_buckets(max_batch) if b <= max_batch} | {max_batch})
    table: dict[tuple[int, int], float] = {}
    for depth in sorted(set(depths) | {0}):
        with forced_depth(llm, depth):
            for b in batches:
                points = []
                for m in lengths:
                    params = SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=m, detokenize=False)
                    before = spec_counters(llm)
                    t0 = time.perf_counter()
                    llm.generate([{"prompt_token_ids": list(prompt)}] * b, [params] * b, use_tqdm=False)
                    wall = time.perf_counter() - t0
                    drafts = spec_counters(llm)["drafts"] - before["drafts"]
                    points.append((wall, drafts / b if depth > 0 else m - 1))
                (w1, s1), (w2, s2) = points
                table[(b, depth)] = max(w2 - w1, 1e-6) / max(s2 - s1, 1e-6)
    return table


def table_for(costs: dict[tuple[int, int], float], acceptance: float | None, max_depth: int, max_batch: int,
              max_spec_batch: int | None = None) -> DepthTable:
    """The depth table for `acceptance` (the prior when None) over measured costs cost(B, d): the smallest
    measured batch >= B answers for B (the largest beyond them)."""
    measured = sorted({b for b, _ in costs})

    def cost(batch: int, tokens: int) -> float:  # depth.py's convention: tokens per row = 1 + depth
        b = next((m for m in measured if m >= batch), measured[-1])
        # a deeper step never costs less than a shallower one: timing noise must not make a draft look free
        return max(c for (bb, d), c in costs.items() if bb == b and d <= tokens - 1)

    rate = PRIOR_ACCEPTANCE if acceptance is None else acceptance
    return depth_table_from_costs(cost, rate, max_depth, max_batch, max_spec_batch)
