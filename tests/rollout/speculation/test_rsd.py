"""Tree children drawn without replacement, verified by recursive rejection sampling (RSD).

Child j of a node is drawn from q_j = q with the earlier children removed, renormalised; it is
accepted with min(1, p_j(x_j) / q_j(x_j)) and a rejection moves on to p_{j+1} = norm(max(0, p_j - q_j)).
Verified here: the drafter-side sampler's law, the one-node law and acceptance against exact
enumerations, and the engine's law with the learned drafter's trees at T = 1. The known-wrong
variant (the i.i.d. rule on such children: q not updated after a rejection) fails the same tests;
the Markov-chain version of both is in test_verify.py / test_verify_flaws.py ("wor").
"""
import itertools
import math

import pytest
import torch

import rlspec.rollout.speculation.drafters.eagle3_draws as eagle3_draws
from rlspec.rollout.runtime.sampling import sample_without_replacement
from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
from rlspec.rollout.speculation.verify import verify_tree
from rlspec.rollout.types import SamplingParams
from tests.rollout.law_helpers import ALPHA, chi2_pvalue, one_thread, sequence_pvalue, spy_siblings  # noqa: F401
from tests.rollout.speculation.test_law import LENGTH, N, PROMPT, engine_samples, exact, hf  # noqa: F401  (fixture)

V, W, B = 6, 3, 200_000
P = torch.softmax(torch.tensor([0.0, 1.5, 1.2, 1.0, 0.3, 0.0]), -1)  # synthetic target at one node
Q = torch.softmax(torch.tensor([2.5, 1.5, 0.5, 0.0, -0.5, -1.0]), -1)  # a peaked drafter that disagrees


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


def _restricted(q: torch.Tensor, removed) -> torch.Tensor:
    q = q.clone()
    q[list(removed)] = 0
    return q / q.sum()


def test_sample_without_replacement_has_the_sequential_law():
    """Ordered triples follow q(a) q(b)/(1-q(a)) q(c)/(1-q(a)-q(b)); each returned distribution is q
    with the earlier draws removed; past the end of the support the distributions are zero."""
    q = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
    tokens, dists = sample_without_replacement(q.expand(B, V), W, torch.Generator().manual_seed(0))
    assert tokens.shape == (B, W) and dists.shape == (B, W, V)
    triples = list(itertools.permutations(range(V), W))
    exact = torch.tensor([float(q[a] * _restricted(q, [a])[b] * _restricted(q, [a, b])[c]) for a, b, c in triples])
    codes = (tokens * torch.tensor([V * V, V, 1])).sum(-1)
    counts = torch.bincount(codes, minlength=V ** 3)[[a * V * V + b * V + c for a, b, c in triples]]
    assert counts.sum() == B  # no repeated token, no zero-probability token
    assert chi2_pvalue(counts, exact) > ALPHA
    for row in range(5):
        a, b, _ = tokens[row].tolist()
        assert torch.allclose(dists[row, 0], q) and torch.allclose(dists[row, 2], _restricted(q, [a, b]))
    _, short = sample_without_replacement(torch.tensor([[0.7, 0.3, 0, 0, 0, 0.0]]), W, None)
    assert short[0, 2].abs().sum() == 0  # two tokens of support, a third draw has nothing left


def exact_acceptance(p, q, draws: str) -> float:
    """P(some child accepted) by enumerating every ordered set of W children and, for each, the
    recursive rule's rejection probabilities (independent of rollout's code)."""
    total = 0.0
    seqs = itertools.product(range(V), repeat=W) if draws == "iid" else itertools.permutations(range(V), W)
    for xs in seqs:
        prob, running, q_j, reject_all = 1.0, p.double(), q.double(), 1.0
        for j, x in enumerate(xs):
            prob *= float(q_j[x])
            reject_all *= 1 - min(1.0, float(running[x] / q_j[x]))
            r = (running - q_j).clamp(min=0)
            running = r / r.sum() if r.sum() > 0 else running
            if draws == "without_replacement":
                q_j = _restricted(q_j, [x])
        total += prob * (1 - reject_all)
    return total


def one_node(draws: str, told: str = "as_drawn", seed: int = 0):
    """B nodes with W children drawn from Q (i.i.d. or without replacement, by torch.multinomial),
    verified by verify_tree against P -> (first emitted token [B], whether a child was accepted [B])."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.multinomial(Q.expand(B, V), W, replacement=draws == "iid", generator=g)
    if draws == "iid" or told == "shared":
        qs = Q.expand(B, W, V)
    else:  # child j's q: Q without the children drawn before it
        qs = torch.stack([Q.expand(B, V)] + [_restricted_rows(xs[:, :j]) for j in range(1, W)], 1)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), xs], 1)  # node 0 is the parent
    children = torch.tensor([[1, 2, 3]] + [[-1] * W] * W).expand(B, W + 1, W)
    logits = torch.log(P).expand(B, W + 1, V)  # T = 1: the processed p is P itself
    q = torch.cat([torch.zeros(B, 1, V), qs], 1)
    v = verify_tree(logits, tokens, children, SamplingParams(temperature=1.0), q, g)
    first = torch.where(v.accepted > 0, tokens.gather(1, v.path[:, :1].clamp(min=0)).squeeze(1), v.next_token)
    return first, v.accepted > 0


def _restricted_rows(removed: torch.Tensor) -> torch.Tensor:
    """[B, V]: Q with each row's removed tokens [B, j] zeroed, renormalised."""
    q = Q.expand(len(removed), V).scatter(-1, removed, 0.0)
    return q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("draws", ["iid", "without_replacement"])
def test_one_node_law_and_acceptance_are_exact(draws):
    first, accepted = one_node(draws)
    assert chi2_pvalue(torch.bincount(first, minlength=V), P) > ALPHA
    rate, expect = accepted.double().mean().item(), exact_acceptance(P, Q, draws)
    assert abs(rate - expect) < 5 * math.sqrt(expect * (1 - expect) / B), (rate, expect)


def test_without_replacement_accepts_more_than_iid():
    """Distinct children never waste a slot on a token already rejected: on this pair (a peaked q
    that disagrees with p) acceptance at a 3-child node rises from ~0.73 to ~0.96."""
    iid = one_node("iid")[1].double().mean().item()
    wor = one_node("without_replacement")[1].double().mean().item()
    assert wor >= iid + 0.1, (iid, wor)


def test_iid_rule_on_without_replacement_children_is_caught():
    first, _ = one_node("without_replacement", told="shared")
    assert chi2_pvalue(torch.bincount(first, minlength=V), P) <= ALPHA


def sharp_eagle3(runtime, draws="without_replacement"):
    """The cold learned drafter with its head scaled 6x: a peaked q (top-1 often > 0.5) is where
    drawing without replacement matters, and where a wrong sibling rule shows."""
    d = Eagle3Drafter(runtime, tree_draws=draws)
    with torch.no_grad():
        d.model.lm_head.weight.mul_(6.0)
    return d


def run_t1(hf, monkeypatch):
    """N engine completions with eagle3 trees of 3 root children at T = 1 -> (p-value, sibling counts,
    rows drawn by sample_without_replacement)."""
    seen, calls = spy_siblings(monkeypatch), []
    real = eagle3_draws.sample_without_replacement

    def counting(q, k, g, u=None):
        calls.append(len(q))
        return real(q, k, g, u)

    monkeypatch.setattr(eagle3_draws, "sample_without_replacement", counting)
    params = SamplingParams(temperature=1.0)
    samples, _ = engine_samples(hf, PROMPT, params, N, LENGTH, sharp_eagle3, width=3, k=1)
    seqs, probs, _ = exact(hf, params)
    return sequence_pvalue(samples, seqs, probs), seen, sum(calls)


def test_eagle3_trees_without_replacement_keep_the_law_at_t1(hf, monkeypatch):
    p, seen, drawn = run_t1(hf, monkeypatch)
    assert p > ALPHA, p
    assert drawn >= N  # the root children really were drawn without replacement
    assert min(seen["first"], seen["later"], seen["none"]) >= 1000, seen


def test_iid_rule_on_eagle3_without_replacement_children_is_caught(hf, monkeypatch):
    """The drafter draws without replacement but reports the unrestricted q for every child, so
    verification applies SpecInfer's i.i.d. rule (q not updated after a rejection)."""
    real = sample_without_replacement

    def shared_q(q, k, g, u=None):
        tokens, _ = real(q, k, g, u)
        return tokens, q[:, None].expand(-1, k, -1)

    monkeypatch.setattr(eagle3_draws, "sample_without_replacement", shared_q)
    p, seen, drawn = run_t1(hf, monkeypatch)
    assert drawn >= N
    assert p <= ALPHA, p
