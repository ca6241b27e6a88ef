"""Judge verification and the lossy chain verify it shares with step routing (docs/lossy.md#judge).

`verify_lossy_chain` runs the lossless chain kernel, verify_chain (rollout/speculation/verify.py), with its
`kept` acceptance test set to two more ways to keep a draft token: the judge accepted it (`judged`),
or the router kept the row's whole drafted step (`keep_rows`). A position passes if the exact test OR
the judge accepts it; the accepted span ends at the first token both reject, where the next token is
drawn from the exact residual norm(max(0, p - q)), or from p after a fully accepted draft. Same
kernel, same draws: with no judge acceptance and no kept step the result is verify_chain's, draw for
draw (tests/rollout/lossy/test_judge.py). It also
returns the exact law each emitted token was drawn with (rollout/lossy/law.py), which is why a
verdict is applied only where that law is computable: the learned judge on point-mass drafts, a
kept step only when every token of it is a point mass.

Judge rules (`judge_accepts`), per draft position i with x = x_i and p = p_i the target's processed
distribution there:
  prob     p(x) >= tau
  typical  p(x) > min(tau, sqrt(tau) * exp(-H(p)))      (typical acceptance, Medusa; eps = tau)
  relative p(x) >= tau * max_v p(v)                      (a near-tie with the target's own choice)
  learned  sigmoid(w . LN(h_i) + b) >= tau, h_i the target's last hidden state at x's node
`judge_vocab` gives the first three over the whole vocabulary, for the law of a sampled draft.
The learned head's labels (`judge_labels`): 1 when x lies in the target's 0.9-nucleus at i.
"""
from __future__ import annotations

import torch

from rlspec.rollout.lossy.law import chain_law, greedy_law, target_law
from rlspec.rollout.runtime.sampling import probs_from_logits
from rlspec.rollout.speculation.verify import verify_chain
from rlspec.rollout.types import SamplingParams

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
    return _rule(rule, tau, p, p.gather(-1, x[..., None]).squeeze(-1), lambda t: t)


def judge_vocab(rule: str, tau: float, p: torch.Tensor) -> torch.Tensor:
    """[B, K, V] bool: would the judge keep token v, had it been drafted at position k? For the rules that
    read p alone (prob, relative, typical); `judge_accepts` is this verdict at the drafted tokens, computed
    by the same expressions. The exact law of a judged position with a sampled draft needs it
    (rollout/lossy/law.py)."""
    if rule == "learned":
        raise ValueError("judge_vocab: the learned judge reads the target's hidden state after the drafted "
                         "token, so its verdict on tokens not drafted is unknown")
    return _rule(rule, tau, p, p, lambda t: t[..., None])


def _rule(rule: str, tau: float, p: torch.Tensor, px: torch.Tensor, per_row) -> torch.Tensor:
    """The rule on px (p at the drafted tokens [B, K], or p itself [B, K, V]); per_row broadcasts a
    [B, K] statistic of p against px."""
    if rule == "prob":
        return px >= tau
    if rule == "relative":
        return px >= tau * per_row(p.amax(-1))
    if rule == "typical":
        entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)
        return px > per_row(torch.minimum(torch.full_like(entropy, tau), tau ** 0.5 * torch.exp(-entropy)))
    raise ValueError(f"unknown judge rule {rule!r}")


def judge_labels(p: torch.Tensor, x: torch.Tensor, mass: float = NUCLEUS) -> torch.Tensor:
    """[B, K] float: 1 where x is in p's nucleus of `mass` (the tokens more probable than x hold < mass)."""
    px = p.gather(-1, x[..., None])
    above = (p * (p > px)).sum(-1)
    return (above < mass).float()


def verify_lossy_chain(target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                       params: SamplingParams, draft_probs: torch.Tensor | None, generator,
                       judged: torch.Tensor | None, keep_rows: torch.Tensor | None, p: torch.Tensor | None = None,
                       judged_vocab: torch.Tensor | None = None):
    """-> (Verdict, source [B, K] long: the token_source of each accepted position, EmitLaw: the exact law
    each emitted token was drawn with, rollout/lossy/law.py). judged [B, K] bool or None; keep_rows [B]
    bool or None; p: the processed target distribution [B, K+1, V] if the caller has it; judged_vocab
    [B, K, V] bool: the judge's verdict on every token (judge_vocab), judged at the drafted tokens.

    Without judged_vocab a verdict is known only at the drafted token, so it applies only where q is a
    point mass (q(x) = 1); a kept step likewise needs a point mass at every position. Elsewhere the law
    of the emitted token would need the verdict on tokens not drafted: those positions and rows are
    verified exactly (lossless), so every recorded law stays exact. Positions past `accepted` carry
    arbitrary codes (the caller reads accepted ones)."""
    B, K = draft_tokens.shape
    dev = draft_tokens.device
    in_range = torch.arange(K, device=dev)[None, :] < num_drafts[:, None]
    q_x = torch.ones(B, K, device=dev) if draft_probs is None else \
        draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    point = q_x >= 1  # a deterministic draft (or a sampled q that put all its mass on x)
    judged = torch.zeros(B, K, dtype=torch.bool, device=dev) if judged is None else judged
    judged = judged if judged_vocab is not None else judged & point
    keep = torch.zeros(B, dtype=torch.bool, device=dev) if keep_rows is None else keep_rows
    keep = keep & (point | ~in_range).all(-1)
    if not params.greedy and p is None:
        p = probs_from_logits(target_logits, params)
    # the lossless chain kernel, with the judge's and the router's verdicts as its acceptance test
    verdict = verify_chain(target_logits, draft_tokens, num_drafts, params, draft_probs, generator,
                           kept=judged | keep[:, None], p=p)
    source = torch.where(keep[:, None], ROUTED, torch.where(verdict.exact, DRAFT_EXACT, JUDGE))
    if params.greedy:
        return verdict, source, greedy_law(source, verdict.accepted)
    if K == 0:
        return verdict, source, target_law(B, 0, dev)
    kept = (judged | keep[:, None]) & in_range
    law = chain_law(p[:, :K], draft_probs, draft_tokens, q_x, kept, judged_vocab, keep, verdict, num_drafts)
    return verdict, source, law
