"""Router scores and labels, step boundaries and the online head, against hand-computed values."""
import math

import pytest
import torch

from rlspec.rollout.lossy.heads import OnlineHead
from rlspec.rollout.lossy.router import agreement_labels, likelihood_scores, step_features
from rlspec.rollout.lossy.steps import StepBoundary


def test_likelihood_score_by_hand():
    logits = torch.log(torch.tensor([[[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]]]))  # [B=1, K=2, V=3]
    p = torch.softmax(logits, -1)
    x = torch.tensor([[1, 0]])
    h = [-sum(v * math.log(v) for v in row) for row in ([0.7, 0.2, 0.1], [0.4, 0.4, 0.2])]
    want = ((math.log(0.2) + h[0]) + (math.log(0.4) + h[1])) / 2
    got = likelihood_scores(logits, p, x, torch.tensor([[True, True]]), temperature=1.0)
    assert got.item() == pytest.approx(want, abs=1e-6)
    only_first = likelihood_scores(logits, p, x, torch.tensor([[True, False]]), temperature=1.0)
    assert only_first.item() == pytest.approx(math.log(0.2) + h[0], abs=1e-6)
    assert likelihood_scores(logits, p, x, torch.tensor([[False, False]]), 1.0).item() == float("-inf")


def test_agreement_label_by_hand():
    p = torch.tensor([[[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]]])
    x = torch.tensor([[1, 0]])
    mask = torch.tensor([[True, True]])
    # deterministic draft: rates p(x) = 0.2, 0.4 -> mean 0.3 < 0.5
    assert agreement_labels(p, x, torch.ones(1, 2), mask).item() == 0.0
    # sampled draft with q(x) = 0.25, 0.4: rates 0.8, 1.0 -> mean 0.9 >= 0.5
    assert agreement_labels(p, x, torch.tensor([[0.25, 0.4]]), mask).item() == 1.0


def test_step_features_mean_over_the_steps_tokens():
    h = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [100.0, 100.0]]])
    assert step_features(h, torch.tensor([[True, True, False]])).tolist() == [[2.0, 1.0]]


def test_step_boundary_single_token_and_straddling():
    texts = ["a", "\n\n", "\n", "b.\n", "\nc", "x\n\ny"]
    sb = StepBoundary(texts, "\n\n")
    assert sb.closes(None, 1) and sb.closes(0, 5)  # the delimiter inside one token
    assert sb.closes(3, 4) and sb.closes(2, 2)  # "...\n" then "\n..."
    assert not sb.closes(0, 2) and not sb.closes(None, 2)
    assert sb.cut(0, [0, 3, 4, 0, 1]) == 3  # the step ends at the token completing "\n\n"
    assert sb.cut(0, [0, 0]) == 2
    assert sb.cut(3, [4, 0]) == 1  # straddling the pending token and the first draft


def test_online_head_learns_a_separable_label():
    torch.manual_seed(0)
    head = OnlineHead(8, warmup=128, train_every=64, steps=8)
    assert not head.ready
    for _ in range(30):
        x = torch.randn(64, 8)
        head.add(x, (x[:, 0] > 0).float())
    assert head.ready and head.seen == 30 * 64
    x = torch.randn(2000, 8)
    assert ((head.score(x) > 0.5) == (x[:, 0] > 0)).float().mean() > 0.8
