"""trainers.ppo_math against values computed by hand (the arithmetic is in the comments)."""
from __future__ import annotations

import math

import pytest
import torch

from rlspec.trainers.ppo import maths as ppo_math

T = torch.tensor


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32),
                          atol=tol), f"{actual} != {expected}"


def test_gae_with_an_episode_ending_mid_batch_and_padding():
    # gamma 0.9, lam 0.5 -> gamma * lam = 0.45. Row 1 ends after 2 tokens; its padded value 9.0 must not leak.
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = T([[0.5, 0.6, 0.7], [0.1, 0.2, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = ppo_math.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0: d2 = 1 - 0.7 = 0.3;  d1 = 0.9*0.7 - 0.6 = 0.03 -> A1 = 0.03 + 0.45*0.3 = 0.165
    #        d0 = 0.9*0.6 - 0.5 = 0.04 -> A0 = 0.04 + 0.45*0.165 = 0.11425
    # row 1: last real token t=1 is terminal: d1 = 2 - 0.2 = 1.8 = A1; d0 = 0.9*0.2 - 0.1 = 0.08 -> A0 = 0.08 + 0.81
    close(adv, [[0.11425, 0.165, 0.3], [0.89, 1.8, 0.0]])
    close(ret, [[0.61425, 0.765, 1.0], [0.99, 2.0, 0.0]])  # returns = A + V, 0 on padding


def test_gae_lambda_one_gives_discounted_returns():
    adv, ret = ppo_math.gae(T([[1.0, 0.0, 2.0]]), T([[0.3, 0.2, 0.1]]), T([[1.0, 1.0, 1.0]]), gamma=0.5, lam=1.0)
    close(ret, [[1.0 + 0.25 * 2.0, 0.5 * 2.0, 2.0]])  # Monte Carlo: sum of gamma^k r_{t+k}
    close(adv, ret - T([[0.3, 0.2, 0.1]]))


def test_whiten_uses_masked_unbiased_statistics():
    x = T([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # real entries 1, 2, 3, 4: mean 2.5, unbiased variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    std = math.sqrt(5 / 3)
    close(ppo_math.whiten(x, mask), [[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]])
    close(ppo_math.whiten(x, mask, shift_mean=False),
          [[2.5 - 1.5 / std, 2.5 - 0.5 / std, 2.5 + 0.5 / std], [2.5 + 1.5 / std, 0.0, 0.0]])


def test_clipped_policy_loss_inside_and_outside_the_range():
    ratios = T([[1.5, 0.5, 1.1, 0.5, 7.0]])
    old = T([[-1.0] * 5])
    logprobs = old + ratios.log()
    adv = T([[1.0, 1.0, -1.0, -1.0, 50.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last token is padding and must not count
    loss, stats = ppo_math.policy_loss(logprobs, old, adv, mask, cliprange=0.2)
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5, A=1:  max(-1.5, -1.2) = -1.2 (clipped);   r=0.5, A=1:  max(-0.5, -0.8) = -0.5
    #   r=1.1, A=-1: max(1.1, 1.1) = 1.1 (not clipped); r=0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped)
    close(loss, (-1.2 - 0.5 + 1.1 + 0.8) / 4)
    close(stats["clipfrac"], 0.5)
    log_sq = math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2 + math.log(1.1) ** 2
    close(stats["approxkl"], 0.5 * log_sq / 4)
    weighted, _ = ppo_math.policy_loss(logprobs, old, adv, mask, cliprange=0.2, is_weights=T([[2.0, 1.0, 1.0, 0.5, 1.0]]))
    close(weighted, (-2.4 - 0.5 + 1.1 + 0.4) / 4)


def test_policy_loss_gradient_vanishes_where_clipped():
    old = T([[0.0, 0.0]])
    logprobs = (old + T([[1.5, 1.1]]).log()).requires_grad_(True)
    loss, _ = ppo_math.policy_loss(logprobs, old, T([[1.0, 1.0]]), T([[1.0, 1.0]]), cliprange=0.2)
    loss.backward()
    close(logprobs.grad, [[0.0, -1.1 / 2]])  # d(-A r)/d logp = -A r, averaged over 2 tokens


def test_clipped_value_loss():
    old = T([[0.0, 0.0, 1.0, 0.0]])
    values = T([[0.5, 0.1, 0.5, 0.5]])
    returns = T([[1.0, 1.0, 0.0, 0.3]])
    loss, stats = ppo_math.value_loss(values, old, returns, T([[1.0] * 4]), cliprange_value=0.2)
    # t0: clip V to 0.2: max((0.5-1)^2=0.25, (0.2-1)^2=0.64) = 0.64 (clipped)
    # t1: inside the range: (0.1-1)^2 = 0.81;  t2: clip to 0.8: max(0.25, 0.64) = 0.64 (clipped)
    # t3: clip to 0.2: max((0.5-0.3)^2=0.04, (0.2-0.3)^2=0.01) = 0.04 (unclipped)
    close(loss, 0.5 * (0.64 + 0.81 + 0.64 + 0.04) / 4)
    close(stats["clipfrac"], 0.5)


def test_explained_variance_by_hand():
    # masked returns [1, 0, 1] (the 4th position is padding), values [0.5, 0.5, 1]:
    # Var(R) = 2/9, R - V = [0.5, -0.5, 0] with mean 0 -> Var = 1/6; 1 - (1/6) / (2/9) = 0.25
    returns = torch.tensor([[1.0, 0.0, 1.0, 7.0]])
    values = torch.tensor([[0.5, 0.5, 1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert ppo_math.explained_variance(values, returns, mask).item() == pytest.approx(0.25)
    assert ppo_math.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    # predicting the mean exactly explains nothing
    assert ppo_math.explained_variance(torch.full_like(returns, 2 / 3), returns, mask).item() == pytest.approx(0.0)
    # all returns equal (every completion wrong): undefined, NaN (the metric store drops it), not -1e8 * error
    assert math.isnan(ppo_math.explained_variance(values, torch.zeros_like(returns), mask).item())


def test_kl_estimators():
    logprobs, ref = T([-1.0, -2.0]), T([-1.5, -1.0])
    close(ppo_math.kl_penalty(logprobs, ref, "k1"), [0.5, -1.0])  # log pi - log pi_ref
    # k3 = (r - 1) - log r, log r = ref - logp = [-0.5, 1.0]
    close(ppo_math.kl_penalty(logprobs, ref, "k3"), [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1])
    with pytest.raises(ValueError, match="k1"):
        ppo_math.kl_penalty(logprobs, ref, "k2")


def test_token_rewards_put_the_score_on_the_last_real_token():
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = T([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    rewards = ppo_math.token_rewards(T([1.0, 2.0]), mask, kl, kl_coef=0.5)
    close(rewards, [[-0.05, -0.1, -0.15 + 1.0], [-0.2, -0.25 + 2.0, 0.0]])
    close(ppo_math.token_rewards(T([1.0, 2.0]), mask), [[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])


def test_importance_weights_truncate_or_mask_and_report_trl_metrics():
    old, engine, mask = T([[-1.0, -1.0, -1.0, 0.0]]), T([[-1.0, -2.0, -0.5, -5.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    # ratio = exp(old - engine) = [1, e, exp(-0.5)] on real tokens
    weights, metrics = ppo_math.importance_weights(old, engine, mask, "token_truncate", cap=2.0)
    close(weights[:, :3], [[1.0, 2.0, math.exp(-0.5)]])
    close(metrics["sampling/sampling_logp_difference/mean"], 0.5)
    close(metrics["sampling/sampling_logp_difference/max"], 1.0)
    close(metrics["sampling/importance_sampling_ratio/min"], math.exp(-0.5))
    close(metrics["sampling/importance_sampling_ratio/mean"], (1.0 + 2.0 + math.exp(-0.5)) / 3)
    close(metrics["sampling/importance_sampling_ratio/max"], 2.0)
    masked, _ = ppo_math.importance_weights(old, engine, mask, "token_mask", cap=2.0)
    close(masked[:, :3], [[1.0, 0.0, math.exp(-0.5)]])


def test_entropy_of_a_uniform_distribution():
    close(ppo_math.entropy_from_logits(torch.zeros(2, 4)), [math.log(4)] * 2)
