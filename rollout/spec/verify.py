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

from rollout.runtime.sampling import probs_from_logits, sample
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
    if draft_probs is None:
        q_draft = torch.ones(B, K, device=p.device)  # one-hot q: q_i(x_i) = 1
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(B, K, generator=generator, device=p.device)
    ok = _accept(u, p[:, :K], q_draft, draft_tokens) & in_range
    accepted = ok.long().cumprod(-1).sum(-1)  # [B]

    # Distribution of the next token: residual at the first rejection, or p itself for the bonus.
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, accepted]  # [B, V]
    rejected = accepted < num_drafts
    q_next = _q_at(draft_probs, draft_tokens, accepted.clamp(max=max(K - 1, 0)), p_next)  # [B, V]
    dist = torch.where(rejected[:, None], _residual(p_next, q_next), p_next)
    return Verdict(accepted, sample(dist, generator))


def _accept(u: torch.Tensor, p: torch.Tensor, q_x: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Accept x with probability min(1, p(x) / q(x)): u < p/q  <=>  u * q < p (no division by zero).

    u, q_x, x: [...]; p: [..., V] the target's processed distribution where x was drafted.
    """
    return u * q_x < p.gather(-1, x[..., None]).squeeze(-1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim. Its mass is 0 only where p == q on the support, where a
    rejection has probability 0; p stands in so the expression stays defined."""
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def _q_at(draft_probs, draft_tokens, idx, like) -> torch.Tensor:
    """The drafter's distribution at position idx[b] per row: [B, V] (one-hot when deterministic)."""
    if draft_tokens.shape[1] == 0:
        return torch.zeros_like(like)
    rows = torch.arange(draft_tokens.shape[0], device=like.device)
    if draft_probs is not None:
        return draft_probs[rows, idx]
    return torch.zeros_like(like).scatter_(-1, draft_tokens[rows, idx][:, None], 1.0)


@dataclass
class TreeVerdict:
    path: torch.Tensor  # [B, N] long: accepted node indices (1..N) by depth, -1 after the last
    accepted: torch.Tensor  # [B] long
    next_token: torch.Tensor  # [B] long


def verify_tree(
    target_logits: torch.Tensor,  # [B, N+1, V]: node 0 is the pending token, node j+1 is draft j
    node_tokens: torch.Tensor,  # [B, N+1] long (node 0's entry unused)
    children: torch.Tensor,  # [B, N+1, W] long: child node indices of each node, -1 = none
    params: SamplingParams,
    draft_probs: torch.Tensor | None = None,  # [B, N+1, V]: q at each node, its children drawn i.i.d. from it
    generator: torch.Generator | None = None,
) -> TreeVerdict:
    """Walk the tree from the root, trying a node's children one at a time against a running p_i.

    Deterministic children (draft_probs None): accept x with probability p_i(x); on rejection
    p_{i+1} = p_i with x removed, renormalised. Children drawn i.i.d. from q (SpecInfer): accept
    with min(1, p_i(x) / q(x)); on rejection p_{i+1} = norm(max(0, p_i - q)). An accepted child
    resets the running distribution to the target's p at that child; when every child of the
    current node is rejected (or it is a leaf) the next token is drawn from the running p_i.
    Greedy: descend into the child equal to argmax p, emit argmax p where none matches.
    The loop runs a fixed N x W times (no data-dependent exit, so no host sync).
    """
    B, N1, W = children.shape
    rows = torch.arange(B, device=node_tokens.device)
    cur = torch.zeros(B, dtype=torch.long, device=rows.device)
    alive = torch.ones(B, dtype=torch.bool, device=rows.device)
    path = torch.full((B, N1 - 1), -1, dtype=torch.long, device=rows.device)
    accepted = torch.zeros(B, dtype=torch.long, device=rows.device)
    greedy = params.greedy
    top = target_logits.argmax(-1) if greedy else None
    p = None if greedy else probs_from_logits(target_logits, params)
    dist = None if greedy else p[:, 0]
    for depth in range(N1 - 1):
        moved = torch.zeros(B, dtype=torch.bool, device=rows.device)
        for w in range(W):
            child = children[rows, cur, w]
            cand = alive & ~moved & (child >= 0)
            x = node_tokens[rows, child.clamp(min=0)]
            if greedy:
                ok = cand & (x == top[rows, cur])
            else:
                q_row = (draft_probs[rows, cur] if draft_probs is not None
                         else torch.zeros_like(dist).scatter_(-1, x[:, None], 1.0))
                u = torch.rand(B, generator=generator, device=rows.device)
                ok = cand & _accept(u, dist, q_row.gather(-1, x[:, None]).squeeze(-1), x)
                dist = torch.where((cand & ~ok)[:, None], _residual(dist, q_row), dist)
                dist = torch.where(ok[:, None], p[rows, child.clamp(min=0)], dist)
            cur = torch.where(ok, child, cur)
            moved |= ok
        path[:, depth] = torch.where(moved, cur, path[:, depth])
        alive &= moved
        accepted += moved.long()
    if greedy:
        next_token = top[rows, cur]
    else:
        next_token = sample(dist, generator)
    return TreeVerdict(path, accepted, next_token)
