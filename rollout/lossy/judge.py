"""Judge verification and the lossy chain verify it shares with step routing (docs/lossy.md#judge).

`verify_lossy_chain` is verify_chain (rollout/spec/verify.py) with two more ways to keep a draft
token: the judge accepted it (`judged`), or the router kept the row's whole drafted step
(`keep_rows`). A position passes if the exact test OR the judge accepts it; the accepted span ends
at the first token both reject, where the next token is drawn from the exact residual
norm(max(0, p - q)), or from p after a fully accepted draft, exactly as in verify_chain. The
uniform draws are made in the same order as verify_chain's, so with no judge acceptance and no
kept step the result is verify_chain's, draw for draw (tests/rollout/lossy/test_judge.py).

Judge rules (`judge_accepts`), per draft position i with x = x_i and p = p_i the target's processed
distribution there:
  prob     p(x) >= tau
  typical  p(x) > min(tau, sqrt(tau) * exp(-H(p)))      (typical acceptance, Medusa; eps = tau)
  relative p(x) >= tau * max_v p(v)                      (a near-tie with the target's own choice)
  learned  sigmoid(w . LN(h_i) + b) >= tau, h_i the target's last hidden state at x's node
The learned head's labels (`judge_labels`): 1 when x lies in the target's 0.9-nucleus at i.
"""
from __future__ import annotations

import torch

from rollout.runtime.sampling import probs_from_logits, sample
from rollout.spec.verify import Verdict, _accept, _q_at, _residual
from rollout.types import SamplingParams

# token_source codes (rollout.types.TOKEN_SOURCES)
TARGET, DRAFT_EXACT, JUDGE, ROUTED = 0, 1, 2, 3
NUCLEUS = 0.9  # judge label: "acceptable" = inside the target's nucleus of this mass


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the judge and router read: the call's processed p (temperature 1 when greedy)."""
    return torch.softmax(logits, -1) if params.greedy else probs_from_logits(logits, params)


def judge_accepts(rule: str, tau: float, p: torch.Tensor, x: torch.Tensor, head_scores=None) -> torch.Tensor:
    """[B, K] bool: the judge keeps x [B, K] drafted where the target's distribution is p [B, K, V]."""
    if rule == "learned":
        return head_scores >= tau
    px = p.gather(-1, x[..., None]).squeeze(-1)
    if rule == "prob":
        return px >= tau
    if rule == "relative":
        return px >= tau * p.amax(-1)
    if rule == "typical":
        entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)
        return px > torch.minimum(torch.full_like(px, tau), tau ** 0.5 * torch.exp(-entropy))
    raise ValueError(f"unknown judge rule {rule!r}")


def judge_labels(p: torch.Tensor, x: torch.Tensor, mass: float = NUCLEUS) -> torch.Tensor:
    """[B, K] float: 1 where x is in p's nucleus of `mass` (the tokens more probable than x hold < mass)."""
    px = p.gather(-1, x[..., None])
    above = (p * (p > px)).sum(-1)
    return (above < mass).float()


def verify_lossy_chain(target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                       params: SamplingParams, draft_probs: torch.Tensor | None, generator,
                       judged: torch.Tensor | None, keep_rows: torch.Tensor | None, p: torch.Tensor | None = None):
    """-> (Verdict, source [B, K] long: the token_source of each accepted position, logq [B, K]: log q(x)
    of the draft distribution, 0 for a deterministic draft). judged [B, K] bool or None; keep_rows [B]
    bool or None; p: the processed target distribution [B, K+1, V] if the caller has it. Positions past
    `accepted` carry arbitrary codes (the caller reads accepted ones)."""
    B, K = draft_tokens.shape
    dev = draft_tokens.device
    in_range = torch.arange(K, device=dev)[None, :] < num_drafts[:, None]
    judged = torch.zeros(B, K, dtype=torch.bool, device=dev) if judged is None else judged
    keep = torch.zeros(B, dtype=torch.bool, device=dev) if keep_rows is None else keep_rows
    q_x = torch.ones(B, K, device=dev) if draft_probs is None else \
        draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    if params.greedy:
        top = target_logits.argmax(-1)
        exact = top[:, :K] == draft_tokens
    else:
        p = probs_from_logits(target_logits, params) if p is None else p
        if K == 0:
            return Verdict(torch.zeros(B, dtype=torch.long, device=dev), sample(p[:, 0], generator)), \
                torch.zeros(B, 0, dtype=torch.long, device=dev), torch.zeros(B, 0, device=dev)
        u = torch.rand(B, K, generator=generator, device=dev)
        exact = _accept(u, p[:, :K], q_x, draft_tokens)
    ok = ((exact | judged | keep[:, None]) & in_range)
    accepted = ok.long().cumprod(-1).sum(-1)
    source = torch.where(exact, DRAFT_EXACT, JUDGE)
    source = torch.where(keep[:, None], ROUTED, source)
    logq = q_x.clamp(min=1e-30).log()
    if params.greedy:
        return Verdict(accepted, top.gather(1, accepted[:, None]).squeeze(1)), source, logq
    rows = torch.arange(B, device=dev)
    p_next = p[rows, accepted]
    rejected = accepted < num_drafts
    q_next = _q_at(draft_probs, draft_tokens, accepted.clamp(max=max(K - 1, 0)), p_next)
    dist = torch.where(rejected[:, None], _residual(p_next, q_next), p_next)
    return Verdict(accepted, sample(dist, generator)), source, logq
