"""Sequence: the engine's plain-Python record of one sample being generated (no tensors here)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlspec.rollout.types import RolloutResult


@dataclass
class Sequence:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    max_new_tokens: int  # already clipped so prompt + completion fits the context
    row: int = -1  # block-table row while live
    admit_order: int = -1  # first admission's rank: preemption takes the youngest (highest) first
    resumed: bool = False  # preempted: its KV must be recomputed by a prefill when readmitted
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # per token: the log-prob of the law it was drawn from, and who produced it (rollout.types.TOKEN_SOURCES)
    behaviour_logprobs: list[float] = field(default_factory=list)
    token_source: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    carried: int = 0  # completion tokens it came in with from an earlier call (partial rollouts, rollout/partial.py)
    key: int | None = None  # its random key (generate(sample_keys=...), rollout/runtime/draws.py)

    def __post_init__(self) -> None:
        self._prompt_len = len(self.prompt_ids)  # a sequence's prompt never changes; cache_len is read ~5x a step

    @property
    def cache_len(self) -> int:
        """Entries in the KV cache: every token but the last sampled one (it is fed next step)."""
        return self._prompt_len + len(self.completion_ids) - 1

    @property
    def pending(self) -> int:
        return self.completion_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.completion_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def ids(self, start: int, stop: int) -> list[int]:
        """all_ids()[start:stop] without copying the whole sequence (drafters read a few new tokens a step)."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.completion_ids[start - P:stop - P]
        return self.prompt_ids[start:stop] + self.completion_ids[:max(stop - P, 0)]

    def append(self, tokens: list[int], logprobs: list[float], stop_ids: set[int], sources: list[int] | None = None,
               behaviour: list[float] | None = None) -> int:
        """Append emitted tokens, stopping at a stop token or the length limit. Returns how many were kept.
        sources: token_source codes (None: all the target's); behaviour: None = logprobs (lossless)."""
        kept = 0
        sources = sources or [0] * len(tokens)
        behaviour = behaviour or logprobs
        for tok, lp, src, blp in zip(tokens, logprobs, sources, behaviour):
            self.completion_ids.append(tok)
            self.logprobs.append(lp)
            self.token_source.append(src)
            self.behaviour_logprobs.append(blp)
            kept += 1
            if tok in stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.completion_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        return kept

    def append_one(self, tok: int, logprob: float, stop_ids: set[int]) -> int:
        """append([tok], [logprob], stop_ids) for one token of the target's law, without its per-token lists."""
        self.completion_ids.append(tok)
        self.logprobs.append(logprob)
        self.token_source.append(0)
        self.behaviour_logprobs.append(logprob)
        if tok in stop_ids:
            self.finish_reason = "stop"
        elif len(self.completion_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return 1

    def result(self, policy_version: int) -> RolloutResult:
        return RolloutResult(
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.completion_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "length",
            policy_version=policy_version,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            behaviour_logprobs=list(self.behaviour_logprobs),
            token_source=list(self.token_source),
        )
