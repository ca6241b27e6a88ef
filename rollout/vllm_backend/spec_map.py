"""SpecConfig -> vLLM's speculative_config, and the fixed selector's policy as vLLM's per-batch-size depth table.

Plain Python (no vLLM, no torch at import), so the mapping is checked in the main environment too.
The maths of the table is the fixed selector's (docs/selectors.md#fixed-selector) evaluated
once per batch-size bucket instead of once per decode step (docs/vllm_backend.md#the-depth-table).
"""
from __future__ import annotations

from dataclasses import dataclass

from rlspec.rollout.types import SpecConfig

# rlspec drafter -> vLLM speculative method. suffix needs vLLM's optional Arctic Inference package.
METHODS = {"ngram": "ngram", "suffix": "suffix", "eagle3": "eagle3"}
# prompt lookup n-gram sizes, as rlspec's n-gram drafter matches (rollout/speculation/drafters/ngram.py)
NGRAM_MIN, NGRAM_MAX = 1, 4


class UnsupportedSpec(ValueError):
    """A SpecConfig the vLLM backend cannot honour; the message says which field and what to use."""


def check_supported(spec: SpecConfig) -> None:
    """Raise UnsupportedSpec, naming the field and the fix, for what vLLM cannot do as rlspec does."""
    if not spec.enabled:
        return
    if spec.drafter == "auto":
        raise UnsupportedSpec("drafter: auto chooses among drafters per decode step, which vLLM cannot (one "
                              "speculative method per engine); with rollout.backend=vllm pick one of "
                              f"{sorted(METHODS)} or none")
    if spec.drafter in ("ngram_device", "suffix_device"):
        raise UnsupportedSpec(f"drafter: {spec.drafter} looks up n-grams on the engine backend's own device; with "
                              "rollout.backend=vllm use ngram or suffix (vLLM runs those itself)")
    if spec.drafter not in METHODS:
        raise UnsupportedSpec(f"drafter: {spec.drafter!r} is an rlspec plug-in vLLM does not know; with "
                              f"rollout.backend=vllm use one of {sorted(METHODS)} or none")
    if spec.tree_width != 1:
        raise UnsupportedSpec(f"tree_width: {spec.tree_width} asks for draft trees; the vLLM backend drafts "
                              "chains only: set drafter.tree_width=1")
    if spec.selector == "adaptive":
        raise UnsupportedSpec("selector: adaptive is a per-step bandit over drafters and shapes that vLLM's "
                              "scheduler cannot call; use fixed (a per-batch-size depth table from the cost "
                              "model) or always (num_draft_tokens at every step)")


@dataclass(frozen=True)
class DepthTable:
    """vLLM's num_speculative_tokens_per_batch_size: inclusive (first, last, depth) batch-size ranges
    from 1 to max_batch, depth 0 = speculation off in that range."""

    ranges: tuple[tuple[int, int, int], ...]

    def depth(self, batch: int) -> int:
        return next(d for lo, hi, d in self.ranges if lo <= batch <= hi)

    @property
    def max_depth(self) -> int:
        return max(d for _, _, d in self.ranges)

    def as_vllm(self) -> list[tuple[int, int, int]]:
        return [tuple(r) for r in self.ranges]


def depth_table(choose, max_batch: int, max_spec_batch: int | None = None) -> DepthTable:
    """The depth each batch-size bucket gets: choose(batch) -> depth at the bucket's largest batch, for
    buckets 1, 2, 4, ... (the cost model's own buckets, rollout/speculation/cost_model.py), merged where equal.

    choose: e.g. `lambda b: selector.choose(b).depth` of a calibrated FixedSelector. Above
    max_spec_batch (the user's cap) the depth is 0 whatever the costs say."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    ranges: list[list[int]] = []
    lo, b = 1, 1
    while lo <= max_batch:
        hi = min(b, max_batch)
        d = 0 if max_spec_batch is not None and hi > max_spec_batch else int(choose(hi))
        if ranges and ranges[-1][2] == d:
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi, d])
        lo, b = hi + 1, b * 2
    return DepthTable(tuple(tuple(r) for r in ranges))


def speculative_config(spec: SpecConfig, drafter_dir: str | None = None,
                       table: DepthTable | None = None) -> dict | None:
    """vLLM's speculative_config for `spec` (None: no speculation).

    drafter_dir: the exported EAGLE-3 directory (eagle3 only). table: the fixed selector's depth table
    (selector fixed); without it every step drafts num_draft_tokens (selector always)."""
    check_supported(spec)
    if not spec.enabled:
        return None
    if table is not None and table.max_depth == 0:
        return None  # the costs say speculation never pays at any batch size: decode plainly
    method = METHODS[spec.drafter]
    k = table.max_depth if table is not None else spec.num_draft_tokens
    out: dict = {"method": method, "num_speculative_tokens": k}
    if method == "eagle3":
        if not drafter_dir:
            raise UnsupportedSpec("drafter: eagle3 needs an exported drafter directory (drafter_path, or the "
                                  "run's own drafter exported on the fly)")
        out["model"] = drafter_dir
        # drafts sampled from the drafter's q and accepted with min(1, p/q), as the engine's: vLLM's default
        # (greedy drafts, accepted with p(draft)) accepts far less at the temperatures RL samples at
        # (bench_out/vllm_acceptance.json: 1.52 vs 1.74 tokens per verify at T = 1); greedy requests still
        # draft greedily
        out["draft_sample_method"] = "probabilistic"
    elif method == "ngram":
        out.update(prompt_lookup_min=NGRAM_MIN, prompt_lookup_max=NGRAM_MAX)
    elif method == "suffix":
        out["suffix_decoding_max_tree_depth"] = max(24, k)
    if table is not None:  # even one range: vLLM then keeps a per-batch-size lookup the backend can replace
        out["num_speculative_tokens_per_batch_size"] = table.as_vllm()
    return out
