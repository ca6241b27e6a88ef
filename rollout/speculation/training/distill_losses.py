"""Drafter losses, one registry: how far the drafter's q is from the target's p at one position.

At T > 0 a sampled draft is accepted with probability sum_x min(p, q) = 1 - TV(p, q)
(docs/drafter_training.md#acceptance), so the drafter must match the target's whole processed
distribution, not its samples.
Every loss here is a pure function of one batch of positions:

    loss(logits, target) -> (per-position loss [M], counts [M] bool)

logits [M, Vd] float32 are the drafter's over its draft vocabulary, already divided by the
sampling temperature (so softmax(logits) is the q it samples from at inference, before top-k/top-p);
target is a DraftTarget: the target's top-k mapped to draft ids. Target tokens outside the draft
vocabulary can never be proposed, so their mass joins the leftover.

  ce       cross-entropy of the token the target sampled: a one-sample estimate of the forward-KL
           gradient (the first loss the drafter trained with). Positions whose token is outside the draft
           vocabulary do not count.
  kl       forward KL(p || q) between the two distributions coarsened to (the top-k ids, "the rest"):
           sum_i p_i log(p_i / q_i) + r log(r / q_rest). The exact gradient of what "ce" estimates.
  tv       1 - sum_i min(p_i, q_i) over the top-k ids: the rejection probability, exactly what
           acceptance loses (the leftover counts as unmatched, so this bounds TV from above).
  tv_kl    tv + 0.1 kl: TV's gradient vanishes where q > p and is flat elsewhere; a little KL keeps
           every target token pulling (DistillSpec found TV and forward KL both good for sampling).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rlspec.rollout.registry import DRAFTER_LOSSES


@dataclass
class DraftTarget:
    """The target's distribution at M positions in draft ids. ids [M, k] long (-1: not in the draft
    vocabulary, its prob is 0 here), probs [M, k] float32, rest [M] float32 (mass outside the
    usable top-k ids), sampled [M] long: the draft id of the token the target emitted, -1 if none."""
    ids: torch.Tensor
    probs: torch.Tensor
    rest: torch.Tensor
    sampled: torch.Tensor


LossFn = Callable[[torch.Tensor, DraftTarget], tuple[torch.Tensor, torch.Tensor]]
LOSSES = DRAFTER_LOSSES  # name -> LossFn, the one registry of drafter losses (rollout/registry.py)
register = LOSSES.register


def get_loss(name: str) -> LossFn:
    """The loss registered as `name` (ValueError naming every registered loss otherwise)."""
    return LOSSES.get(name)


def draft_target(ids: torch.Tensor, probs: torch.Tensor, rest: torch.Tensor, has: torch.Tensor,
                 sampled: torch.Tensor, t2d: torch.Tensor) -> DraftTarget:
    """Map a top-k target (ids [M, k] target ids, probs [M, k], rest [M], has [M] bool) and the
    sampled target ids [M] to draft ids via t2d [V] (-1 = absent). Positions without a distribution
    (has False: prompt positions) get the one-hot of their sampled token, so every loss reduces to
    a sampled-token loss there (forward KL to a one-hot is cross-entropy)."""
    sampled_d = t2d[sampled]
    d_ids = t2d[ids.long()]
    p = probs.float().masked_fill(d_ids < 0, 0.0)
    r = rest.float() + probs.float().masked_fill(d_ids >= 0, 0.0).sum(-1)
    r = r.masked_fill(r < 1e-6, 0.0)  # rounding of 1 - sum(top-k), not mass: it must not pull on q_rest
    one_hot_ids = torch.full_like(d_ids, -1)
    one_hot_ids[:, 0] = sampled_d
    one_hot_p = torch.zeros_like(p)
    one_hot_p[:, 0] = (sampled_d >= 0).float()
    hs = has[:, None]
    return DraftTarget(torch.where(hs, d_ids, one_hot_ids), torch.where(hs, p, one_hot_p),
                       torch.where(has, r.clamp(min=0.0), (sampled_d < 0).float()), sampled_d)


def _q_topk(logq: torch.Tensor, t: DraftTarget) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q at the target's usable top-k ids [M, k] (-inf where unusable), log q of every other
    draft id together [M])."""
    Vd = logq.shape[-1]
    ok = t.ids >= 0
    col = torch.where(ok, t.ids, Vd)  # unusable entries point at a dummy column
    padded = torch.cat([logq, logq.new_full((len(logq), 1), float("-inf"))], -1)
    at = padded.gather(-1, col).masked_fill(~ok, float("-inf"))
    others = padded.scatter(-1, col, float("-inf"))[:, :Vd]  # duplicates (-1 entries) hit the dummy
    return at, torch.logsumexp(others, -1)


@register("ce")
def ce_loss(logits: torch.Tensor, t: DraftTarget):
    ok = t.sampled >= 0
    return F.cross_entropy(logits, t.sampled.clamp(min=0), reduction="none") * ok, ok


@register("kl")
def kl_loss(logits: torch.Tensor, t: DraftTarget):
    at, rest_q = _q_topk(torch.log_softmax(logits, -1), t)
    p = t.probs
    inside = (torch.xlogy(p, p) - p * at.clamp(min=-30.0)).sum(-1)  # clamp: 0 * -inf at unusable ids
    outside = torch.xlogy(t.rest, t.rest) - t.rest * rest_q.clamp(min=-30.0)
    return inside + outside, torch.ones_like(t.sampled, dtype=torch.bool)


@register("tv")
def tv_loss(logits: torch.Tensor, t: DraftTarget):
    at, _ = _q_topk(torch.log_softmax(logits, -1), t)
    overlap = torch.minimum(t.probs, at.exp()).sum(-1)
    return 1.0 - overlap, torch.ones_like(t.sampled, dtype=torch.bool)


@register("tv_kl")
def tv_kl_loss(logits: torch.Tensor, t: DraftTarget):
    tv, ok = tv_loss(logits, t)
    kl, _ = kl_loss(logits, t)
    return tv + 0.1 * kl, ok
