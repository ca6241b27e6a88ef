"""Statistical tests of verification on a Markov-chain target and drafter (fast, exact law known).

Each run samples B windows of L = 5 tokens through the real verify_chain / verify_tree with ragged
draft lengths, garbage in the padding, sibling counts that vary per row, and compares their joint
law with the exact one (tests/rollout/speculation/markov.py) at the suite's threshold ALPHA. Drafts have
at most K = 3 tokens and the window is L = 5, so the token after a fully accepted draft (the bonus)
lies inside it. The table of known-wrong verifiers that this same test catches, drawing the bonus
wrongly among them, is in test_verify_flaws.py.
"""
import pytest
import torch

import rlspec.rollout.speculation.verify as verify
from rlspec.rollout.types import SamplingParams
from tests.rollout.law_helpers import ALPHA, one_thread, sibling_events  # noqa: F401  (fixture)
from tests.rollout.speculation.markov import K, P_LOGITS, V, chain_step, sample_window, tree_step, window_pvalue

B = 40_000
SETTINGS = {"T1": SamplingParams(temperature=1.0), "T0.7-top_p0.8": SamplingParams(temperature=0.7, top_p=0.8),
            "T0.8-top_k3": SamplingParams(temperature=0.8, top_k=3),
            "T1-torch": SamplingParams(temperature=1.0)}  # chains by the torch rule where the CPU kernel serves T1


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


def run(params, mode, seed=0, **kw):
    """B windows sampled with drafts of the given kind: chain "sampled" / "deterministic", or a tree
    whose root children are drawn "iid", "wor" (without replacement) or "topk"."""
    if mode in ("sampled", "deterministic"):
        def step(prev, gen):
            return chain_step(prev, params, gen, deterministic=mode == "deterministic", **kw)
    else:
        def step(prev, gen):
            return tree_step(prev, params, gen, mode, **kw)
    return sample_window(step, B, seed)


CHAINS, TREES = ["sampled", "deterministic"], ["iid", "wor", "topk"]
# trees have no kernel, so the torch-rule setting pairs with chains only (T1 covers trees)
CASES = [(s, m) for s in sorted(SETTINGS) for m in CHAINS + TREES if not (s.endswith("-torch") and m in TREES)]


@pytest.mark.parametrize("setting,mode", CASES, ids=[f"{m}-{s}" for s, m in CASES])
def test_real_verifier_keeps_target_law(setting, mode, monkeypatch):
    """The window's joint law equals the target's; the paths the law depends on were exercised. Chains at T1 run
    through the CPU kernel where it is built (kernels/verify_chain.cpp: counted), and through the torch rule too."""
    from rlspec.rollout.runtime.model import kernels

    params = SETTINGS[setting]
    if setting.endswith("-torch"):
        monkeypatch.setattr(verify, "_chain_op", lambda *a: None)
    seen = {"full": 0, "later_sibling": 0, "kernel": 0}
    real_chain, real_tree, real_op = verify.verify_chain, verify.verify_tree, verify._chain_op

    def op_spy(*a):
        v = real_op(*a)
        seen["kernel"] += v is not None
        return v

    def chain_spy(logits, drafts, num, *a):
        v = real_chain(logits, drafts, num, *a)
        seen["full"] += int(((v.accepted == num) & (num == K)).sum())  # a bonus after K accepted drafts
        return v

    def tree_spy(logits, tokens, children, *a):
        v = real_tree(logits, tokens, children, *a)
        seen["later_sibling"] += sibling_events(children, v.path)["later"]  # a child after an earlier sibling
        return v

    monkeypatch.setattr(verify, "verify_chain", chain_spy)
    monkeypatch.setattr(verify, "verify_tree", tree_spy)
    monkeypatch.setattr(verify, "_chain_op", op_spy)
    samples = run(params, mode)
    assert window_pvalue(samples, params) > ALPHA
    key = "full" if mode in ("sampled", "deterministic") else "later_sibling"
    assert seen[key] >= 1000, seen
    if setting == "T1" and mode in CHAINS and kernels.available():
        assert seen["kernel"] > 0, seen


def test_greedy_chain_and_tree_follow_argmax():
    params = SamplingParams(temperature=0)
    prev = torch.arange(V)
    drafts = P_LOGITS[prev].argmax(-1)[:, None]  # first draft right, second wrong on purpose
    wrong = (P_LOGITS[drafts[:, 0]].argmax(-1) + 1) % V
    d = torch.cat([drafts, wrong[:, None]], 1)
    ctx = torch.cat([prev[:, None], d], 1)
    v = verify.verify_chain(P_LOGITS[ctx], d, torch.full((V,), 2), params)
    assert v.accepted.tolist() == [1] * V
    assert v.next_token.tolist() == P_LOGITS[drafts[:, 0]].argmax(-1).tolist()
    # ragged: a row with no drafts emits argmax at the pending token
    v0 = verify.verify_chain(P_LOGITS[ctx], d, torch.tensor([0] + [2] * (V - 1)), params)
    assert v0.accepted[0] == 0 and v0.next_token[0] == P_LOGITS[0].argmax()
    # a tree whose root has the wrong token first and the right one second descends into the second
    tokens = torch.stack([prev, wrong, drafts[:, 0]], 1)
    children = torch.tensor([[1, 2], [-1, -1], [-1, -1]]).expand(V, 3, 2)
    t = verify.verify_tree(P_LOGITS[tokens], tokens, children, params)
    assert t.path[:, 0].tolist() == [2] * V and t.accepted.tolist() == [1] * V
    assert t.next_token.tolist() == P_LOGITS[drafts[:, 0]].argmax(-1).tolist()


def test_q_of_the_wrong_shape_is_refused():
    params = SamplingParams(temperature=1.0)
    d = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="draft_probs has shape"):
        verify.verify_chain(torch.zeros(2, 4, V), d, torch.full((2,), 3), params, torch.rand(2, 3, V + 1))
    with pytest.raises(ValueError, match="draft_probs has shape"):
        verify.verify_tree(torch.zeros(2, 4, V), torch.zeros(2, 4, dtype=torch.long),
                           torch.full((2, 4, 1), -1), params, torch.rand(2, 3, V))


@pytest.mark.parametrize("draws", ["generator", "keyed"])
def test_a_tree_walk_told_its_depth_skips_the_rounds_past_it_with_the_same_draws(draws):
    """A binary tree two levels deep holds six nodes, so the walk's six rounds include four in which no row has a
    child to try. Told the depth, verify_tree skips their work: the same paths and tokens as the full walk, and a
    shared generator advanced by the same uniforms (its next draw agrees), for sampled and greedy verification."""
    from rlspec.rollout.runtime.draws import KeyedDraws

    rows, n = 64, 6
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (rows, n + 1), generator=g)
    parent = [-1, 0, 0, 1, 1, 2, 2]  # node -> parent node: root -> 1, 2; 1 -> 3, 4; 2 -> 5, 6
    children = torch.tensor([[1, 2], [3, 4], [5, 6], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]).expand(rows, n + 1, 2)
    logits = torch.randn(rows, n + 1, V, generator=g) * 0.3
    for node in range(1, n + 1):  # each parent favours its children's tokens: walks often reach depth 2
        logits[torch.arange(rows), parent[node], tokens[:, node]] += 1.0

    def walk(params, depth):
        if draws == "keyed":
            source = KeyedDraws("cpu", list(range(rows))).bind(list(range(rows)), [7] * rows)
        else:
            source = torch.Generator().manual_seed(11)
        v = verify.verify_tree(logits, tokens, children, params, None, source, depth)
        after = None if draws == "keyed" else torch.rand(4, generator=source)  # where the stream stands
        return v.path, v.accepted, v.next_token, after

    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0)):
        full, cut = walk(params, None), walk(params, 2)
        for a, b in zip(full, cut):
            assert a is None and b is None or torch.equal(a, b)
        assert (full[1] == 2).sum() >= 5  # walks to the deepest level occurred
        if not params.greedy:  # and sampled ones that stopped before it
            assert (full[1] < 2).sum() >= 5
