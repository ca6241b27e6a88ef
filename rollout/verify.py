"""Lossless verification of drafted chains: one pure, batched function, no host sync inside.

Notation (reference.md section 1): p_i is the target's processed distribution at draft position i,
q_i the drafter's (processed identically; one-hot for deterministic drafters such as n-gram or
suffix lookups), x_i the drafted token. For each sequence:

  accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first rejection;
  on a rejection at i emit a token from the residual norm(max(0, p_i - q_i));
  if all k drafts are accepted emit a bonus token from p_k.

The emitted sequence then has exactly the law of sampling from p autoregressively (Leviathan et al.,
Chen et al. 2023). For a one-hot q the residual is p with x_i removed and renormalised.
Greedy (temperature 0): accept while x_i == argmax p_i, then emit argmax p at the first mismatch.

Rows are ragged: sequence b drafted num_drafts[b] <= K tokens; positions beyond are padding and
never accepted. Every sequence advances by its own accepted count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.sampling import probs_from_logits
from rollout.types import SamplingParams


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] long: drafts accepted per sequence (0..num_drafts[b])
    next_token: torch.Tensor  # [B] long: the token emitted after the accepted drafts


def verify_chain(
    target_logits: torch.Tensor,  # [B, K+1, V] float32: target logits at the pending token and each draft
    draft_tokens: torch.Tensor,  # [B, K] long
    num_drafts: torch.Tensor,  # [B] long, each <= K
    params: SamplingParams,
    draft_probs: torch.Tensor | None = None,  # [B, K, V] processed drafter probs; None = deterministic
    generator: torch.Generator | None = None,
) -> Verdict:
    B, K = draft_tokens.shape
    in_range = torch.arange(K, device=draft_tokens.device)[None, :] < num_drafts[:, None]  # [B, K]
    if params.greedy:
        target_top = target_logits.argmax(-1)  # [B, K+1]
        ok = (target_top[:, :K] == draft_tokens) & in_range
        accepted = ok.long().cumprod(-1).sum(-1)
        return Verdict(accepted, target_top.gather(1, accepted[:, None]).squeeze(1))

    p = probs_from_logits(target_logits, params)  # [B, K+1, V]
    p_draft = p[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)  # p_i(x_i): [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # one-hot q: q_i(x_i) = 1
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(B, K, generator=generator, device=p.device)
    # u < p/q  <=>  u * q < p (no division by a zero q; a drafter never proposes a q = 0 token).
    ok = (u * q_draft < p_draft) & in_range
    accepted = ok.long().cumprod(-1).sum(-1)  # [B]

    # Distribution of the next token: residual at the first rejection, or p itself for the bonus.
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, accepted]  # [B, V]
    rejected = accepted < num_drafts
    q_next = _q_at(draft_probs, draft_tokens, accepted.clamp(max=max(K - 1, 0)), p_next)  # [B, V]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # mass == 0 only when p == q on the support, in which case rejection has probability 0.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    dist = torch.where(rejected[:, None], residual, p_next)
    next_token = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
    return Verdict(accepted, next_token)


def _q_at(draft_probs, draft_tokens, idx, like) -> torch.Tensor:
    """The drafter's distribution at position idx[b] per row: [B, V] (one-hot when deterministic)."""
    if draft_tokens.shape[1] == 0:
        return torch.zeros_like(like)
    rows = torch.arange(draft_tokens.shape[0], device=like.device)
    if draft_probs is not None:
        return draft_probs[rows, idx]
    return torch.zeros_like(like).scatter_(-1, draft_tokens[rows, idx][:, None], 1.0)
