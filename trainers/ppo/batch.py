"""From engine results to the padded tensors PPO trains on, and the token-level quantities of a batch.

`RolloutBatch` is what one rollout gives (tokens, the engine's logprobs, scores); `Experience` adds
what the trainer computes once per rollout with the policy frozen (old logprobs and values, the
reference logprobs, importance weights, advantages and returns) and then reuses across PPO epochs.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlspec.rollout.padding import pad_rollouts
from rlspec.rollout.types import RolloutResult


@dataclass
class RolloutBatch:
    """One rollout as tensors. B samples; P = longest prompt (left-padded); T = longest completion
    (right-padded). input_ids / attention_mask: (B, P + T); mask, engine_logprobs: (B, T);
    completion_ids: (B, T); scores, finished: (B,) (finished: ended on a stop token)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    engine_logprobs: torch.Tensor
    finished: torch.Tensor
    scores: torch.Tensor | None = None

    @property
    def completion_len(self) -> int:
        return self.mask.shape[1]


@dataclass
class Experience(RolloutBatch):
    """A rollout plus the frozen-policy quantities of the PPO update (all (B, T) but `scores`)."""

    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> Experience:
        """The rows `index` of every tensor (a minibatch)."""
        return Experience(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                             for f in fields(self)})


def pad_results(results: list[RolloutResult], pad_token_id: int, device) -> RolloutBatch:
    """Left-pad prompts and right-pad completions so every completion starts at the same column."""
    input_ids, attention_mask, T = pad_rollouts(results, pad_token_id)
    P = input_ids.shape[1] - T
    engine_logprobs = torch.zeros((len(results), T))
    for i, r in enumerate(results):  # behaviour logprobs: lossy tokens included
        engine_logprobs[i, :len(r.completion_ids)] = torch.tensor(r.sampling_logprobs())
    batch = RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, completion_ids=input_ids[:, P:],
        mask=attention_mask[:, P:].float(), engine_logprobs=engine_logprobs,
        finished=torch.tensor([r.finish_reason == "stop" for r in results]),
    )
    return RolloutBatch(**{f.name: _to(getattr(batch, f.name), device) for f in fields(batch)})


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature): (B, T, V), (B, T) -> (B, T), in float32 (the
    engine's logprobs are of the temperature-scaled law too, so the two compare directly)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
