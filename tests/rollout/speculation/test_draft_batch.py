"""Padding drafts into one verify batch: q lands on the right nodes; inconsistent q is refused."""
import pytest
import torch

from rlspec.rollout.speculation.draft_batch import build_draft_batch
from rlspec.rollout.speculation.drafters.base import Draft
from rlspec.rollout.speculation.verify import verify_chain, verify_tree
from rlspec.rollout.types import SamplingParams

V = 7


def q(n: int, seed: int = 0) -> torch.Tensor:
    r = torch.rand(n, V, generator=torch.Generator().manual_seed(seed))
    return r / r.sum(-1, keepdim=True)


def test_q_is_placed_per_node_and_padding_is_zero():
    chains = [Draft.chain([1, 2], q(2, 1)), Draft(), Draft.chain([3], q(1, 2))]
    b = build_draft_batch([0, 0, 0], chains)
    assert b.is_chain and b.q.shape == (3, 2, V)
    assert torch.equal(b.q[0], chains[0].q) and torch.equal(b.q[2, :1], chains[2].q)
    assert b.q[1].abs().sum() == 0 and b.q[2, 1].abs().sum() == 0
    tree = Draft([4, 5, 6], [-1, -1, 0], q(3, 3))  # two root children, the first with a child
    b = build_draft_batch([0, 0], [tree, Draft.chain([1], q(1, 4))])
    assert not b.is_chain and b.q.shape == (2, 4, V)
    assert torch.equal(b.q[0, 1:], tree.q) and b.q[0, 0].abs().sum() == 0  # node j+1 holds token j's q
    assert b.children[0, 0].tolist() == [1, 2]  # siblings in the order they were drawn
    assert b.depth == 2  # its deepest node (the first child's child): verify_tree walks no further
    assert build_draft_batch([0], [Draft([4, 5, 6], [-1, -1, -1])]).depth == 1  # three root children


@pytest.mark.parametrize("chain", [True, False])
def test_mixing_sampled_and_deterministic_drafts_is_refused(chain):
    """A row without q would read as q = 0 there (always accept): a biased sample, so refuse it."""
    sampled = Draft.chain([1, 2], q(2)) if chain else Draft([1, 2], [-1, -1], q(2))
    plain = Draft.chain([3, 4]) if chain else Draft([3, 4], [-1, -1])
    with pytest.raises(ValueError, match=r"must all carry q or none.*rows \[0\] carry.*rows \[1\] do not.*one-hot q"):
        build_draft_batch([0, 0], [sampled, plain])
    build_draft_batch([0, 0, 0], [sampled, Draft(), sampled])  # an empty draft has no tokens to describe


@pytest.mark.parametrize("bad", [q(3), q(2)[:, :V - 1], q(2)[0], [[0.5] * V] * 2],
                         ids=["too_many_rows", "other_vocab", "one_dim", "not_a_tensor"])
def test_q_of_the_wrong_shape_is_refused(bad):
    with pytest.raises(ValueError, match=r"draft 1 has 2 tokens but q of shape .*\[len\(tokens\), V\]"):
        build_draft_batch([0, 0], [Draft.chain([1], q(1)), Draft.chain([2, 3], bad)])


def test_one_hot_q_is_verified_exactly_like_a_deterministic_draft():
    """What the error message recommends is exact: same verdicts, draw for draw."""
    g = torch.Generator().manual_seed(0)
    B, K = 500, 3
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    num = torch.randint(0, K + 1, (B,), generator=g)
    one_hot = torch.nn.functional.one_hot(drafts, V).float()
    params = SamplingParams(temperature=0.9, top_p=0.9)
    a = verify_chain(logits, drafts, num, params, None, torch.Generator().manual_seed(1))
    b = verify_chain(logits, drafts, num, params, one_hot, torch.Generator().manual_seed(1))
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.next_token, b.next_token)
    assert 0 < a.accepted.float().mean() < K  # rejections and acceptances both happened
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), drafts], 1)
    children = torch.tensor([[1, 2, 3], [-1] * 3, [-1] * 3, [-1] * 3]).expand(B, 4, 3)
    hot = torch.cat([torch.zeros(B, 1, V), one_hot], 1)
    a = verify_tree(logits, tokens, children, params, None, torch.Generator().manual_seed(2))
    b = verify_tree(logits, tokens, children, params, hot, torch.Generator().manual_seed(2))
    assert torch.equal(a.path, b.path) and torch.equal(a.next_token, b.next_token)
