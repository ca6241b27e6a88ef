"""PPO's maths as pure tensor functions (docs/ppo.md derives each one).

Shapes: every per-token tensor is (B, T): B completions, T = the longest completion, right-padded.
`mask` is 1.0 on real completion tokens and 0.0 on padding; a row's real tokens are a prefix (the
engine returns completions that stop at EOS or at the length limit, and we pad on the right).
Nothing here knows about models, trainers or devices, so each function is tested against values
computed by hand (tests/trainers/test_ppo_math.py).
"""
from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k3"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (over all of them, or along `dim`)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of x (Bessel-corrected by default, as the former TRL trainer did)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries; padding comes out 0.

    shift_mean=False keeps the mean (x scaled around it): used for rewards, where the sign of the
    mean reward carries information, while advantages are centred (shift_mean=True).
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's logprobs under both.

    k1 = log pi - log pi_ref (unbiased, high variance, can be negative per token);
    k3 = (r - 1) - log r with r = pi_ref / pi (unbiased, always >= 0, lower variance; Schulman 2020).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """r_t = -kl_coef * kl_t at every real token, plus the sequence's score at its last real token.

    scores: (B,) outcome rewards. kl: (B, T) per-token KL estimates, or None for no penalty.
    """
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    if kl is not None and kl_coef:
        rewards = -kl_coef * kl * mask
    last = (mask.sum(1).long() - 1).clamp(min=0)  # index of each row's last real token
    rows = torch.arange(mask.shape[0], device=mask.device)
    has_tokens = mask.sum(1) > 0
    rewards[rows, last] += scores * has_tokens
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row, back to front. Returns (advantages, returns).

    delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 past a row's last real token (the episode
    ended: EOS or the length limit, both terminal as in verl and the former TRL trainer);
    A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t (the value target). Padding is 0.
    """
    values = values * mask
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(next_adv)  # 0 on padding
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]  # a padded step resets the recursion
        advantages[:, t] = next_adv
    return advantages, (advantages + values) * mask


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cliprange: float, is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate, token-mean: mean(max(-A * r, -A * clip(r, 1-eps, 1+eps))), r = pi / pi_old.

    is_weights: (B, T) detached truncated importance weights pi_old / pi_engine (the engine's sampling
    law vs the trainer's recomputation), multiplied into each token's loss as in TRL's GRPO.
    Returns (loss, stats) with stats clipfrac (share of tokens where the clipped term won) and
    approxkl (0.5 * mean((log r)^2), the former TRL trainer's estimate of KL(pi_old || pi)).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights
    stats = {
        "clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "approxkl": (0.5 * masked_mean(log_ratio.detach() ** 2, mask)),
    }
    return masked_mean(per_token, mask), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, dict]:
    """Clipped value loss: 0.5 * mean(max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2)).

    Returns (loss, stats) with stats clipfrac (share of tokens where the clipped error was larger).
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_err, clipped_err), mask)
    return loss, {"clipfrac": masked_mean((clipped_err > unclipped_err).float(), mask).detach()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the masked tokens (verl's critic/vf_explained_var): 1 is a perfect value
    model, 0 no better than predicting the batch mean, negative worse. Unlike the value loss it does not
    grow when the returns themselves spread out (an outcome reward's variance p(1-p) peaks at p = 0.5),
    so it shows whether the critic is learning while the reward moves."""
    var_returns = masked_var(returns, mask, unbiased=False)
    if var_returns < 1e-8:  # every return equal (e.g. all 8 completions wrong): undefined, not -1e4
        return torch.tensor(float("nan"), device=returns.device)
    return 1 - masked_var(returns - values, mask, unbiased=False) / var_returns


def importance_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: Literal["token_truncate", "token_mask"], cap: float) -> tuple[torch.Tensor, dict]:
    """Per-token importance weights pi_old / pi_engine, truncated at `cap` (token_truncate) or zeroed
    above it (token_mask), as TRL's vllm_importance_sampling_correction; plus TRL's sampling/* metrics
    (logp difference mean/max, ratio min/mean/max over real tokens)."""
    diff = (old_logprobs - engine_logprobs) * mask
    ratio = torch.exp(diff)
    if mode == "token_truncate":
        weights = ratio.clamp(max=cap)
    elif mode == "token_mask":
        weights = ratio.masked_fill(ratio > cap, 0.0)
    else:
        raise ValueError(f"importance_sampling_mode must be 'token_truncate' or 'token_mask', got {mode!r}")
    real = mask.bool()
    delta, kept = diff.abs()[real], weights[real]
    zero = torch.zeros((), device=mask.device)
    metrics = {
        "sampling/sampling_logp_difference/mean": delta.mean() if delta.numel() else zero,
        "sampling/sampling_logp_difference/max": delta.max() if delta.numel() else zero,
        "sampling/importance_sampling_ratio/min": kept.min() if kept.numel() else zero,
        "sampling/importance_sampling_ratio/mean": kept.mean() if kept.numel() else zero,
        "sampling/importance_sampling_ratio/max": kept.max() if kept.numel() else zero,
    }
    return weights.detach(), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's softmax distribution: (..., V) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
