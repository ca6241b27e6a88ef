"""Judge rules and the lossy chain verify against hand-computed values; with nothing judged or kept
it is verify_chain draw for draw."""
import math

import pytest
import torch

from rlspec.rollout.lossy.judge import DRAFT_EXACT, JUDGE, ROUTED, judge_accepts, judge_labels, verify_lossy_chain
from rlspec.rollout.speculation.verify import verify_chain
from rlspec.rollout.types import SamplingParams

P = torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])  # [B=1, K=1, V=4]


def test_prob_rule_is_a_threshold_on_the_targets_probability():
    x = torch.tensor([[1]])  # p(x) = 0.3
    assert judge_accepts("prob", 0.3, P, x).item()
    assert not judge_accepts("prob", 0.31, P, x).item()


def test_relative_rule_is_a_threshold_against_the_targets_top_probability():
    # p(x) / max p = 0.3 / 0.5 = 0.6 and 0.15 / 0.5 = 0.3
    assert judge_accepts("relative", 0.6, P, torch.tensor([[1]])).item()
    assert not judge_accepts("relative", 0.61, P, torch.tensor([[1]])).item()
    assert judge_accepts("relative", 0.3, P, torch.tensor([[2]])).item()
    assert not judge_accepts("relative", 0.31, P, torch.tensor([[2]])).item()
    # a flatter row accepts the same absolute probability at a higher tau: the bar moves with the top
    flat = torch.tensor([[[0.3, 0.3, 0.3, 0.1]]])
    assert judge_accepts("relative", 1.0, flat, torch.tensor([[1]])).item()
    assert not judge_accepts("prob", 1.0, flat, torch.tensor([[1]])).item()


def test_typical_rule_by_hand():
    entropy = -sum(v * math.log(v) for v in (0.5, 0.3, 0.15, 0.05))  # 1.1468 nats
    eps = 0.2
    bar = min(eps, math.sqrt(eps) * math.exp(-entropy))  # 0.1418: 0.15 passes, 0.05 does not
    assert 0.05 < bar < 0.15
    assert judge_accepts("typical", eps, P, torch.tensor([[2]])).item()
    assert not judge_accepts("typical", eps, P, torch.tensor([[3]])).item()


def test_learned_rule_reads_the_head_scores():
    scores = torch.tensor([[0.2, 0.7]])
    assert judge_accepts("learned", 0.5, None, None, scores).tolist() == [[False, True]]


def test_nucleus_labels():
    # tokens more probable than x hold 0, 0.5, 0.8, 0.95 of the mass: inside the 0.9-nucleus for the first three
    x = torch.tensor([[0, 1, 2, 3]])
    assert judge_labels(P.expand(1, 4, 4), x).tolist() == [[1.0, 1.0, 1.0, 0.0]]


@pytest.mark.parametrize("sampled_q", [False, True])
def test_nothing_judged_is_verify_chain_draw_for_draw(sampled_q):
    g = torch.Generator().manual_seed(0)
    B, K, V = 6, 4, 11
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    x = torch.randint(V, (B, K), generator=g)
    num = torch.tensor([0, 1, 2, 3, 4, 4])
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if sampled_q else None
    params = SamplingParams(temperature=0.8, top_p=0.9)
    for seed in range(5):
        want = verify_chain(logits, x, num, params, q, torch.Generator().manual_seed(seed))
        got, source, _ = verify_lossy_chain(logits, x, num, params, q, torch.Generator().manual_seed(seed),
                                            torch.zeros(B, K, dtype=torch.bool), torch.zeros(B, dtype=torch.bool))
        assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_token, want.next_token)
        for b in range(B):
            assert (source[b, :got.accepted[b]] == DRAFT_EXACT).all()


def _greedy_case():
    """Target argmax per node: 1, 2, 3, 0. Draft [1, 0, 3]: exact accepts 1, rejects 0 (argmax 2)."""
    logits = torch.full((1, 4, 5), -5.0)
    for node, top in enumerate([1, 2, 3, 0]):
        logits[0, node, top] = 5.0
    logits[0, 1, 0] = 4.0  # the draft's second token is the target's runner-up there
    return logits, torch.tensor([[1, 0, 3]]), torch.tensor([3])


def test_judge_extends_the_span_to_the_first_token_both_reject():
    logits, x, num = _greedy_case()
    params = SamplingParams(temperature=0)
    v, _, _ = verify_lossy_chain(logits, x, num, params, None, None, None, None)
    assert v.accepted.item() == 1 and v.next_token.item() == 2  # exact alone: stop at the 0
    judged = torch.tensor([[False, True, False]])
    v, source, law = verify_lossy_chain(logits, x, num, params, None, None, judged, None)
    assert v.accepted.item() == 3 and v.next_token.item() == 0  # 1 exact, 0 judged, 3 exact, bonus argmax
    assert source[0].tolist() == [DRAFT_EXACT, JUDGE, DRAFT_EXACT]
    # greedy: the judged token records log 1 = 0, the others the target's logprob (own False)
    assert law.own[0].tolist() == [False, True, False, False] and law.logm[0, 1].item() == 0.0
    judged = torch.tensor([[False, False, True]])  # a judge acceptance after the first double rejection is moot
    v, _, _ = verify_lossy_chain(logits, x, num, params, None, None, judged, None)
    assert v.accepted.item() == 1


def test_a_kept_step_is_accepted_whole_as_a_point_mass():
    logits, x, num = _greedy_case()
    one_hot = torch.zeros(1, 3, 5).scatter_(-1, x[..., None], 1.0)
    v, source, law = verify_lossy_chain(logits, x, num, SamplingParams(temperature=1.0), one_hot,
                                        torch.Generator().manual_seed(0), None, torch.tensor([True]))
    assert v.accepted.item() == 3
    assert source[0].tolist() == [ROUTED] * 3
    assert law.own[0, :3].all() and law.logm[0, :3].tolist() == pytest.approx([0.0] * 3)  # probability 1
    assert not law.own[0, 3]  # the bonus token after the step: the target's own law


def test_a_sampled_step_is_never_kept():
    """The law of a sampled step kept by its content is not computable: the row is verified exactly."""
    logits, x, num = _greedy_case()
    q = torch.full((1, 3, 5), 0.1)
    q[0, 0, 1], q[0, 1, 0], q[0, 2, 3] = 0.6, 0.6, 0.6
    for seed in range(5):
        want = verify_chain(logits, x, num, SamplingParams(temperature=1.0), q, torch.Generator().manual_seed(seed))
        v, source, law = verify_lossy_chain(logits, x, num, SamplingParams(temperature=1.0), q,
                                            torch.Generator().manual_seed(seed), None, torch.tensor([True]))
        assert torch.equal(v.accepted, want.accepted) and torch.equal(v.next_token, want.next_token)
        assert not (source == ROUTED).any() and not law.own.any()
