"""The fixed selector's choice as vLLM's per-batch-size depth table, from step costs.

rlspec's fixed selector (docs/selectors.md#fixed-selector) speculates at depth d when
    gain(B, d) = E[tokens | d] / (cost(B, 1 + d) / cost(B, 1)),   E[tokens | d] = sum_{i=0..d} a^i,
is largest and above 1.05 (its switch-on threshold). vLLM fixes a schedule when it starts, so the
rule is evaluated once per batch-size bucket (spec_map.depth_table) instead of once per step.

The costs are vLLM's own step times, measured in the running engine, and the acceptance is vLLM's
counted one (step_costs.py): the table is rebuilt and installed in vLLM's scheduler whenever the
measured acceptance moves (docs/vllm_backend.md#the-depth-table).
"""
from __future__ import annotations

from collections.abc import Callable

from rlspec.rollout.vllm_backend.spec_map import DepthTable, depth_table

# cost(batch, tokens per row) -> seconds of one target forward of `batch` rows with that many new tokens each
CostFn = Callable[[int, int], float]

SPECULATE_ABOVE = 1.05  # the fixed selector's switch-on gain (selectors/fixed.py, 1 + HYSTERESIS)
PRIOR_ACCEPTANCE = 0.5  # the selector's prior before any verify was measured (cost_model.AcceptanceTracker)


def depths(max_depth: int) -> list[int]:
    """The depths the selector weighs: 1, 2, 4, ... and max_depth."""
    out, d = [], 1
    while d < max_depth:
        out.append(d)
        d *= 2
    return out + [max_depth]


def depth_table_from_costs(cost: CostFn, acceptance: float, max_depth: int, max_batch: int,
                           max_spec_batch: int | None = None) -> DepthTable:
    """The depth per batch-size bucket (0 = no speculation) that maximises the expected speedup at the
    acceptance rate `acceptance` (per drafted token), speculating only where it exceeds SPECULATE_ABOVE."""
    def choose(batch: int) -> int:
        plain = cost(batch, 1)
        gains = {d: sum(acceptance ** i for i in range(d + 1)) / (cost(batch, 1 + d) / plain) for d in depths(max_depth)}
        best = max(gains, key=gains.get)
        return best if gains[best] > SPECULATE_ABOVE else 0

    return depth_table(choose, max_batch, max_spec_batch)
