"""Arbitrage step routing: keep a drafted reasoning step, or have the target regenerate it.

The target scores a drafted step x_1..x_m in the verify forward it runs anyway (node t predicts
x_{t+1}), so the router costs no extra forward. Scores (docs/lossy.md#router):

  likelihood   s = (1/m) sum_t [log p_t(x_t) + H(p_t)]: the draft token's log-likelihood against the
               target's expected log-likelihood of its own sample (-H). s ~ 0: the step reads as
               typical target text; s << 0: the target would rarely have written it. Keep if s >= tau.
  learned      sigmoid(w . LN(mean_t h_t) + b), h_t the target's last hidden state at the step's
               tokens; keep if >= tau. Until the head is trained it keeps nothing (the target
               regenerates every step: lossless).

Router label (`agreement_labels`), computed on every drafted step, kept or not: 1 when the target
agrees with the step, mean_t min(1, p_t(x_t) / q_t(x_t)) >= AGREE, the expected share of the step the
exact (lossless) test would accept token by token; the target's own step is then no better.
"""
from __future__ import annotations

import torch

AGREE = 0.5


def likelihood_scores(logits: torch.Tensor, p: torch.Tensor, x: torch.Tensor, mask: torch.Tensor,
                      temperature: float) -> torch.Tensor:
    """[B]: mean over mask [B, K] of log p_t(x_t) + H(p_t); logits [B, K, V] the target's at the nodes
    predicting x [B, K], p [B, K, V] its processed distribution there. Rows with no token score -inf."""
    logp = torch.log_softmax(logits / max(temperature, 1e-6), -1)
    logp_x = logp.gather(-1, x[..., None]).squeeze(-1)
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)
    m = mask.float()
    total = ((logp_x + entropy) * m).sum(-1)
    count = m.sum(-1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("-inf")))


def agreement_labels(p: torch.Tensor, x: torch.Tensor, q_x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] float: 1 where mean_t min(1, p_t(x_t) / q_t(x_t)) over mask >= AGREE."""
    px = p.gather(-1, x[..., None]).squeeze(-1)
    rate = torch.minimum(torch.ones_like(px), px / q_x.clamp(min=1e-30))
    m = mask.float()
    return ((rate * m).sum(-1) / m.sum(-1).clamp(min=1) >= AGREE).float()


def step_features(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, H]: the mean of the last hidden states hidden [B, K, H] over the step's tokens mask [B, K]."""
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)
