"""Padding drafts into one verify batch: q lands on the right nodes; inconsistent q is refused."""
import pytest
import torch

from rlspec.rollout.speculation.draft_batch import build_draft_batch
from rlspec.rollout.speculation.drafters.base import Draft, DraftTensors
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
    """What the error message recommends is exact. A one-hot q takes the rule for sampled drafts and None draws and
    matches (docs/verification.md#deterministic-drafts): greedy, the same verdicts; sampled, the same law of
    (drafts accepted, next token), chains and trees, by a two-sample chi-square over the same rows."""
    from scipy.stats import chi2_contingency

    from tests.rollout.law_helpers import ALPHA

    g = torch.Generator().manual_seed(0)
    B, K = 20_000, 3
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    num = torch.randint(0, K + 1, (B,), generator=g)
    one_hot = torch.nn.functional.one_hot(drafts, V).float()
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), drafts], 1)
    children = torch.tensor([[1, 2, 3], [-1] * 3, [-1] * 3, [-1] * 3]).expand(B, 4, 3)
    hot = torch.cat([torch.zeros(B, 1, V), one_hot], 1)

    def verdicts(params, q, seed):
        gen = torch.Generator().manual_seed(seed)
        c = verify_chain(logits, drafts, num, params, None if q is None else one_hot, gen)
        t = verify_tree(logits, tokens, children, params, None if q is None else hot, gen)
        return c.accepted * V + c.next_token, t.accepted * V + t.next_token  # (accepted, token) as one category

    greedy = SamplingParams(temperature=0)
    for a, b in zip(verdicts(greedy, None, 1), verdicts(greedy, hot, 1)):
        assert torch.equal(a, b)
    sampled = SamplingParams(temperature=0.9, top_p=0.9)  # truncated: the torch rules, not the CPU kernel
    for a, b in zip(verdicts(sampled, None, 1), verdicts(sampled, hot, 2)):
        assert 0 < (a // V).float().mean() < 1.5  # rejections and acceptances both happened
        table = torch.stack([torch.bincount(a, minlength=(K + 1) * V), torch.bincount(b, minlength=(K + 1) * V)])
        assert chi2_contingency(table[:, table.sum(0) > 0].numpy())[1] > ALPHA


def _tensors(B: int, W: int, D: int, caps: list[int], sampled: bool, seed: int) -> DraftTensors:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, W, D), generator=g)
    if not sampled:
        return DraftTensors(ids, None, caps)
    r = torch.rand(B, W, D, V, generator=g)
    return DraftTensors(ids, r / r.sum(-1, keepdim=True), caps)


CASES = {  # (W, D, caps per row): chains with rows of every length and none; trees cut to every shape
    "chain": (1, 4, [4, 0, 2, 1]),
    "chain_one": (1, 3, [1, 1, 1, 1]),
    "tree_full": (2, 3, [6, 6, 6, 6]),
    "tree_cut": (2, 3, [6, 3, 1, 0]),  # 2 x 3, 2 x 1 (three nodes: the widest within the cap), one root child, none
    "tree_one": (3, 2, [1, 1, 0, 1]),  # one node a row: a chain of one from branch 0
    "tree_wide": (3, 2, [5, 2, 6, 4]),
}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_drafts_on_the_device_verify_as_their_host_form(case, sampled):
    """A learned drafter's DraftTensors make the verify batch its Drafts (to_drafts, the host form) make: the same
    layout and, on every node a row holds, the same tokens and q, so the same verdicts from the same uniforms, greedy
    and sampled (padding nodes may hold other values: no verdict reaches them)."""
    W, D, caps = CASES[case]
    B = len(caps)
    tensors = _tensors(B, W, D, caps, sampled, seed=len(case))
    drafts = tensors.to_drafts()
    assert [len(d) for d in drafts] == tensors.counts()
    for i, d in enumerate(drafts):  # row i: min(W, cap) branches of cap // that many draws, branch after branch
        w = min(W, caps[i])
        n = caps[i] // w if w else 0
        assert d.tokens == tensors.ids[i, :w, :n].flatten().tolist()
        assert d.parents == [-1 if j == 0 else b * n + j - 1 for b in range(w) for j in range(n)]
    pending, start = [1, 2, 0, 1], [5, 9, 3, 7]
    got, ref = build_draft_batch(pending, tensors, start), build_draft_batch(pending, drafts, start)
    assert (got.is_chain, got.N, got.kv_len, got.depth) == (ref.is_chain, ref.N, ref.kv_len, ref.depth)
    for name in ("num_drafts", "start", "depths", "tree_mask", "children"):
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    held = torch.arange(got.N + 1)[None, :] <= torch.tensor([len(d) for d in drafts])[:, None]  # [B, N+1]
    assert torch.equal(got.tokens[held], ref.tokens[held])
    if sampled:
        nodes = held[:, 1:] if got.is_chain else held & (torch.arange(got.N + 1) > 0)
        assert torch.equal(got.q[nodes], ref.q[nodes])
    else:
        assert got.q is None and ref.q is None
    logits = torch.randn(B, got.N + 1, V, generator=torch.Generator().manual_seed(3)) * 2
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0)):
        verdicts = []
        for batch in (got, ref):
            g = torch.Generator().manual_seed(11)
            if batch.is_chain:
                v = verify_chain(logits, batch.tokens[:, 1:], batch.num_drafts, params, batch.q, g)
                verdicts.append((v.accepted, v.next_token))
            else:
                v = verify_tree(logits, batch.tokens, batch.children, params, batch.q, g, batch.depth)
                verdicts.append((v.accepted, v.next_token, v.path))
        assert all(torch.equal(a, b) for a, b in zip(*verdicts))
    if not got.is_chain:
        assert got.children[:, 0].ge(0).sum(-1).tolist() == [min(W, c) if c else 0 for c in caps]
