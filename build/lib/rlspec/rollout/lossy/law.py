"""The exact law with which the lossy chain verify emits each token (docs/lossy.md#the-exact-behaviour-law).

At draft position i of a row, everything conditioned on the prefix emitted so far: the drafter drew
x ~ q, the exact test keeps it with probability a(x) = min(1, p(x) / q(x)), the judge (or a kept
step) keeps it regardless with J(x) in {0, 1}, and otherwise the next token is drawn from the
residual r = norm(max(0, p - q)) and the row stops. The token emitted at i therefore has the law,
marginal over the draft draw (a mixture, not the law of the branch that happened to be taken),

    m(y) = q(y) [a(y) + (1 - a(y)) J(y)] + R r(y),      R = sum_z q(z) (1 - a(z)) (1 - J(z)).

With q a = min(q, p) and q (1 - a) = max(0, q - p):

    m(y) = min(q, p)(y) + max(0, q - p)(y) J(y) + R r(y),      R = S - D,
    S = sum_z max(0, q - p)(z)          the lossless rejection probability,
    D = sum_z max(0, q - p)(z) J(z)     the part of it the judge keeps.

D = 0 gives m = min(q, p) + S r = p: nothing the exact test rejects is kept, the position is
lossless and records the target's own logprob, as lossless speculation does (`own` False). The
token after a fully accepted draft is drawn from p: lossless too. A residual draw y has p(y) > q(y),
so its J term vanishes: m(y) = q(y) + R r(y).

Point-mass q (deterministic drafters; q(x) = 1): S = 1 - p(x), D = S J(x), so m(x) = p(x) +
(1 - p(x)) J(x) and m(y) = (1 - J(x)) p(y) elsewhere: log 1 = 0 where x is kept whatever the exact
test says, the target's logprob otherwise. No vocabulary pass. A sampled q needs S, D and the
residual's mass Z = sum max(0, p - q) over the vocabulary: a few elementwise [B, K, V] operations on
the p and q the verify already holds, and J(z) for every z (rollout/lossy/judge.py: judge_vocab).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlspec.rollout.types import LOSSY_SOURCES


@dataclass
class EmitLaw:
    """Per emitted token of a chain verify: column j < accepted is drafted token j, column `accepted`
    the token drawn after them (residual or bonus); later columns are arbitrary."""

    logm: torch.Tensor  # [B, K+1] float32: log m(token), the pipeline's exact law at that position
    own: torch.Tensor  # [B, K+1] bool: m differs from p there; False: record the target's own logprob


def target_law(B: int, K: int, device) -> EmitLaw:
    """Every position lossless: the caller records the target's logprobs."""
    return EmitLaw(torch.zeros(B, K + 1, device=device), torch.zeros(B, K + 1, dtype=torch.bool, device=device))


def greedy_law(source: torch.Tensor, accepted: torch.Tensor) -> EmitLaw:
    """Greedy decoding (source [B, K], accepted [B]): every law is a point mass. As lossless greedy
    speculation does, the target's and exact tokens record the target's temperature-1 logprob; a token
    kept by a lossy rule records log 1 = 0."""
    B, K = source.shape
    lossy = torch.isin(source, torch.tensor(LOSSY_SOURCES, device=source.device))
    drafted = torch.arange(K, device=source.device)[None, :] < accepted[:, None]
    own = torch.cat([lossy & drafted, torch.zeros(B, 1, dtype=torch.bool, device=source.device)], 1)
    return EmitLaw(torch.zeros(B, K + 1, device=source.device), own)


def chain_law(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor, q_x: torch.Tensor, kept: torch.Tensor,
              kept_vocab: torch.Tensor | None, keep_rows: torch.Tensor, verdict, num: torch.Tensor) -> EmitLaw:
    """p [B, K, V]: the target's processed distribution at the draft positions; q [B, K, V] or None (point
    masses at x); x, q_x = q(x) [B, K]; kept [B, K] bool: J(x), x kept whatever the exact test says (judge
    or kept step); kept_vocab [B, K, V] bool: J over the vocabulary (None: known at x only, where q must
    then be a point mass or J(x) False); keep_rows [B]: rows whose step was kept (point masses);
    verdict: accepted [B], next_token [B]; num [B]: drafts per row."""
    B, K = x.shape
    p_x = p.gather(-1, x[..., None]).squeeze(-1)
    J = kept.to(p.dtype)
    S, D, Z = _masses(p, q, p_x, q_x, J, kept_vocab, keep_rows)
    R = (S - D).clamp(min=0)
    r_x = torch.where(Z > 0, (p_x - q_x).clamp(min=0) / Z.clamp(min=1e-30), p_x)
    m_x = torch.minimum(q_x, p_x) + (q_x - p_x).clamp(min=0) * J + R * r_x
    own = D > 0
    rows = torch.arange(B, device=x.device)
    a, y = verdict.accepted.clamp(max=K - 1), verdict.next_token
    p_y = p[rows, a, y]
    q_y = (x[rows, a] == y).to(p.dtype) if q is None else q[rows, a, y].to(p.dtype)
    r_y = torch.where(Z[rows, a] > 0, (p_y - q_y).clamp(min=0) / Z[rows, a].clamp(min=1e-30), p_y)
    m_y = torch.minimum(q_y, p_y) + R[rows, a] * r_y
    at = verdict.accepted[:, None]
    logm = torch.cat([m_x, torch.ones(B, 1, device=x.device, dtype=p.dtype)], 1)
    logm = logm.scatter(1, at, m_y[:, None]).clamp(min=1e-30).log()
    own = torch.cat([own, torch.zeros(B, 1, dtype=torch.bool, device=x.device)], 1)
    own = own.scatter(1, at, (own[rows, a] & (verdict.accepted < num))[:, None])
    return EmitLaw(logm, own)


def _masses(p, q, p_x, q_x, J, kept_vocab, keep_rows):
    """S, D, Z [B, K] of the module docstring."""
    if q is None:  # max(0, q - p) is 1 - p(x) at x and 0 elsewhere; max(0, p - q) sums to the same
        S = (1 - p_x).clamp(min=0)
        return S, S * J, S
    q = q.to(p.dtype)
    over = (q - p).clamp(min=0)  # [B, K, V]
    S, Z = over.sum(-1), (p - q).clamp(min=0).sum(-1)
    if kept_vocab is None:  # J known at x only: kept only where q is a point mass
        return S, (q_x - p_x).clamp(min=0) * J, Z
    D = torch.where(kept_vocab, over, 0.0).sum(-1)
    D = torch.where(keep_rows[:, None], (q_x - p_x).clamp(min=0), D)  # a kept step: point masses, all kept
    return S, D, Z
