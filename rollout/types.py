"""Public value types of the rollout engine: what a caller asks for and what it gets back.

Plain dataclasses, no torch: they cross process boundaries (Ray) and config files unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SamplingParams:
    """How to sample one generate call (the names follow vLLM's SamplingParams)."""

    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus truncation; 1.0 keeps the whole distribution
    top_k: int = 0  # 0 keeps every token
    max_new_tokens: int = 256
    n: int = 1  # samples per prompt; they share the prompt's prefill
    # None draws fresh randomness each call. What a seed reproduces: on the same device and dtype, with
    # the same prompts, params, weights and engine settings, identical rollouts (tokens and logprobs)
    # when speculation is off. With speculation on, the drafts decide which random numbers are used,
    # so identical rollouts also need the same arm at every step (selector "always"; "fixed" and
    # "adaptive" choose from measured step times, which vary) and the same drafter state (a learned
    # drafter's weights, a suffix/n-gram drafter's index of earlier rollouts). Rollouts with and
    # without speculation, or with other arms, have the same law but are different samples.
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # extra stop tokens besides the tokenizer's EOS
    ignore_eos: bool = False  # benchmarks: always run to max_new_tokens

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SpecConfig:
    """How the engine speculates. The default is no speculation (plain autoregressive decoding)."""

    # "none", "auto" (every registered drafter marked auto: suffix, ngram, eagle3), or a registered
    # drafter name (rollout.spec.registry.DRAFTERS: ngram, suffix, eagle3, and plug-ins)
    drafter: str = "none"
    num_draft_tokens: int = 4  # k: drafted tokens per verify along one path
    tree_width: int = 1  # children per node; 1 = a chain
    # a registered selector (rollout.spec.registry.SELECTORS): "fixed" (the configured shape where
    # measured costs say it pays, deeper as the batch shrinks), "adaptive" (a bandit over drafters
    # and shapes per live-batch bucket), "always" (the configured arm on every step: benchmarks, tests)
    selector: str = "fixed"
    drafter_path: str | None = None  # a learned drafter's directory (eagle3)
    # Long tail: speculate only when the live batch is at most this many sequences; None lets the
    # engine derive it from measured verify costs. Hysteresis keeps it from flapping.
    max_spec_batch: int | None = None
    # eagle3: train the drafter online on the rollouts' own hidden states (in a background thread,
    # on idle compute) and swap new weights in between decode iterations
    online_training: bool = True
    draft_vocab_size: int = 4096  # eagle3: the drafter predicts over the most frequent target tokens

    def __post_init__(self) -> None:
        from rollout.spec.registry import DRAFTERS, SELECTORS  # plain Python: no torch at config time

        if self.drafter not in ("none", "auto"):
            DRAFTERS.check(self.drafter)
        if self.num_draft_tokens < 1:
            raise ValueError(f"SpecConfig.num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.tree_width < 1:
            raise ValueError(f"SpecConfig.tree_width must be >= 1, got {self.tree_width}")
        SELECTORS.check(self.selector)

    @property
    def enabled(self) -> bool:
        return self.drafter != "none"


@dataclass
class RolloutResult:
    """One sample of one prompt.

    logprobs: one float per completion token, log p(token) under the target's
    temperature-scaled distribution before top-k/top-p truncation (what TRL recomputes).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    policy_version: int
    prompt_index: int = 0  # which prompt of the call this sample belongs to
    sample_index: int = 0  # which of that prompt's n samples
    extra: dict = field(default_factory=dict)
