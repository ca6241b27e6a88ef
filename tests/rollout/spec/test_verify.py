"""Statistical tests of verification on a Markov-chain target and drafter (fast, exact law known).

The real verifier must reproduce the target's law; each known-wrong variant (reference.md section 1)
must be caught by the same test, which shows the test has the power to see the bug.
"""
import pytest
import torch
from scipy.stats import chisquare

import rollout.spec.verify as verify
from rollout.runtime.sampling import probs_from_logits
from rollout.types import SamplingParams

V, L, B = 5, 3, 40_000
gen0 = torch.Generator().manual_seed(123)
P_LOGITS = torch.randn(V, V, generator=gen0) * 1.5  # target: next-token logits given the previous token
Q_LOGITS = torch.randn(V, V, generator=gen0) * 1.5  # drafter: a different chain


def exact_law(params):
    trans = probs_from_logits(P_LOGITS, params)  # [V, V]
    law = {}
    for a in range(V):
        for b in range(V):
            for c in range(V):
                law[(a, b, c)] = (trans[0, a] * trans[a, b] * trans[b, c]).item()
    return law


def chain_step(prev, params, K, gen, q_params=None, deterministic=False):
    """Draft K tokens from q, verify with the real function; returns emitted [B, K+1] and counts."""
    q_params = q_params or params
    drafts, qs, cur = [], [], prev
    for _ in range(K):
        if deterministic:
            x = Q_LOGITS[cur].argmax(-1)
        else:
            x = torch.multinomial(probs_from_logits(Q_LOGITS[cur], q_params), 1, generator=gen).squeeze(-1)
        qs.append(probs_from_logits(Q_LOGITS[cur], params))  # q as the verifier is told it
        drafts.append(x)
        cur = x
    drafts = torch.stack(drafts, 1)
    ctx = torch.cat([prev[:, None], drafts], 1)
    v = verify.verify_chain(P_LOGITS[ctx], drafts, torch.full((len(prev),), K), params,
                            None if deterministic else torch.stack(qs, 1), gen)
    emitted = torch.cat([drafts, torch.zeros(len(prev), 1, dtype=torch.long)], 1)
    emitted.scatter_(1, v.accepted[:, None], v.next_token[:, None])
    return emitted, v.accepted + 1


def tree_step(prev, params, gen, deterministic):
    """Root gets two children (i.i.d. from q, or q's top-2), each continued by one more node."""
    n = len(prev)
    q_root = probs_from_logits(Q_LOGITS[prev], params)
    if deterministic:
        c = q_root.topk(2, -1).indices
    else:
        c = torch.multinomial(q_root, 2, replacement=True, generator=gen)
    nodes = [prev, c[:, 0], c[:, 1]]
    for parent in (c[:, 0], c[:, 1]):
        qp = probs_from_logits(Q_LOGITS[parent], params)
        nodes.append(qp.argmax(-1) if deterministic else torch.multinomial(qp, 1, generator=gen).squeeze(-1))
    tokens = torch.stack(nodes, 1)  # [n, 5]: root, c0, c1, child of c0, child of c1
    children = torch.tensor([[1, 2], [3, -1], [4, -1], [-1, -1], [-1, -1]]).expand(n, 5, 2)
    q_nodes = None if deterministic else probs_from_logits(Q_LOGITS[tokens], params)
    v = verify.verify_tree(P_LOGITS[tokens], tokens, children, params, q_nodes, gen)
    path_tokens = tokens.gather(1, v.path.clamp(min=0))
    emitted = torch.cat([path_tokens, torch.zeros(n, 1, dtype=torch.long)], 1)
    emitted.scatter_(1, v.accepted[:, None], v.next_token[:, None])
    return emitted, v.accepted + 1


def sample_law(params, mode="chain", K=3, q_params=None, deterministic=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(B, L, dtype=torch.long)
    filled = torch.zeros(B, dtype=torch.long)
    prev = torch.zeros(B, dtype=torch.long)
    while (filled < L).any():
        if mode == "chain":
            emitted, count = chain_step(prev, params, K, gen, q_params, deterministic)
        else:
            emitted, count = tree_step(prev, params, gen, deterministic)
        for j in range(emitted.shape[1]):
            pos = filled + j
            ok = (j < count) & (pos < L)
            out[ok, pos[ok]] = emitted[ok, j]
        prev = emitted.gather(1, (count - 1)[:, None]).squeeze(1)
        filled += count
    return out


def pvalue(samples, params) -> float:
    law = exact_law(params)
    counts = {}
    for row in samples.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    keys = [k for k, p in law.items() if p * B > 5]
    obs = [counts.get(k, 0) for k in keys]
    exp = [law[k] for k in keys]
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return chisquare(obs, exp).pvalue


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8)]


@pytest.mark.parametrize("params", SETTINGS, ids=["T1", "T0.7-top_p0.8"])
@pytest.mark.parametrize("mode,deterministic", [("chain", False), ("chain", True), ("tree", False),
                                                ("tree", True)])
def test_real_verifier_keeps_target_law(params, mode, deterministic):
    assert pvalue(sample_law(params, mode, deterministic=deterministic), params) > 1e-3


FLAWS = {
    "resample_from_p": ("_residual", lambda p, q: p),
    "lenient_acceptance": ("_accept", lambda u, p, q_x, x: u * q_x < 1.5 * p.gather(-1, x[..., None]).squeeze(-1)),
    "greedy_compare_sampled": ("_accept", lambda u, p, q_x, x: x == p.argmax(-1)),
}


@pytest.mark.parametrize("flaw", sorted(FLAWS))
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_flawed_verifiers_are_caught(monkeypatch, flaw, mode):
    name, broken = FLAWS[flaw]
    monkeypatch.setattr(verify, name, broken)
    params = SETTINGS[0]
    assert pvalue(sample_law(params, mode), params) < 1e-6


def test_temperature_mismatch_between_p_and_q_is_caught():
    """Drafts sampled at T=1 but verified as if q had the target's T=0.7 processing."""
    params = SamplingParams(temperature=0.7)
    samples = sample_law(params, "chain", q_params=SamplingParams(temperature=1.0))
    assert pvalue(samples, params) < 1e-6


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

