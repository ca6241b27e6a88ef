"""Logit processing shared by the target and every drafter, so both see the same distribution.

Speculative sampling is lossless only if p (target) and q (drafter) go through identical
temperature, top-k and top-p processing (reference.md section 1); this is the one place it happens.
"""
from __future__ import annotations

import torch

from rollout.types import SamplingParams


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p(token) under the temperature-scaled distribution before top-k/top-p (what TRL recomputes).

    logits [..., V] float32, tokens [...] long -> [...] float32. Greedy uses temperature 1.
    """
    scaled = logits if params.greedy else logits / params.temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution: softmax(logits / T) truncated by top-k then top-p, renormalised.

    logits [..., V] float32 -> probs [..., V] float32 (rows sum to 1).
    """
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [B, V] -> [B] long, by inverting the CDF at a uniform draw.

    Exact like torch.multinomial (a zero-probability token can never be hit: u is drawn in
    (0, total]) and on CPU over 20x faster for a 49k vocabulary, where multinomial was the largest
    cost of a batch-8 decode step (7 ms against 0.3 ms).
    """
    cdf = probs.cumsum(-1)
    u = (1 - torch.rand(probs.shape[:-1] + (1,), generator=generator, device=probs.device)) * cdf[..., -1:]
    return torch.searchsorted(cdf, u).squeeze(-1).clamp(max=probs.shape[-1] - 1)
