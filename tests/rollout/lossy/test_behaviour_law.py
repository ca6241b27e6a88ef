"""The recorded behaviour logprob is the law the whole pipeline emits a token with (issue 25), by frequency.

Each test draws many seeded rollouts of the same one or two positions at once (one verify call over
ROWS identical rows: fixed target p and draft q, drafts drawn by the test), counts the emitted tokens
per position, and checks them three ways:
  - every row's recorded behaviour probability equals the law this file computes on its own with
    numpy, straight from the formula m(y) = q(y) [a(y) + (1 - a(y)) J(y)] + R r(y) (docs/lossy.md);
  - a chi-square test of the counts against the recorded probabilities passes (p > 0.01);
  - the same test rejects the old record, the target's own p(y) (p < 0.01), wherever the pipeline's
    law differs from it: the test can tell the subtle wrong variant from the right one.
Position 1 is read on the rows whose position 0 was an accepted draft (its law given that prefix).
Lossy modes go through LossyControl.verify and .behaviour, what the engine calls; the lossless chain
and tree through verify_chain / verify_tree and the engine's record, logprobs_of at the node.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rollout.engine import _to_host
from rollout.lossy.control import LossyControl
from rollout.lossy.judge import JUDGE, ROUTED
from rollout.runtime.sampling import logprobs_of, sample_without_replacement
from rollout.speculation.draft_batch import DraftBatch
from rollout.speculation.verify import verify_chain, verify_tree
from rollout.types import SamplingParams, SpecConfig
from tests.rollout.lossy.helpers import TinyTokenizer

ROWS, V, H = 20000, 6, 16
PARAMS = SamplingParams(temperature=1.0)
# target p at draft positions 0, 1 and the bonus position 2; draft q at positions 0, 1. q > p on tokens
# the rules below keep, so the judge moves mass onto them (e.g. 0.30 against p = 0.15 at position 0)
P = np.array([[.40, .25, .15, .10, .06, .04], [.05, .10, .20, .35, .20, .10], [.20, .20, .20, .20, .10, .10]])
Q = np.array([[.10, .15, .30, .25, .15, .05], [.30, .25, .05, .10, .20, .10]])
RULES = [("prob", 0.09), ("relative", 0.22), ("typical", 0.15)]


# ---- the law, computed here independently of rollout/lossy ------------------------------------------
def rule(name: str, tau: float, p: np.ndarray) -> np.ndarray:
    """J over the vocabulary (docs/lossy.md#judge)."""
    return p > bar(name, tau, p) if name == "typical" else p >= bar(name, tau, p)


def bar(name: str, tau: float, p: np.ndarray) -> float:
    if name == "prob":
        return tau
    if name == "relative":
        return tau * p.max()
    entropy = -(p * np.log(p)).sum()
    return min(tau, math.sqrt(tau) * math.exp(-entropy))


def mixture(p: np.ndarray, q: np.ndarray, J: np.ndarray) -> np.ndarray:
    """m(y) = q(y) [a(y) + (1 - a(y)) J(y)] + R r(y): the law of the token emitted at a position whose
    draft is drawn from q, kept by the exact test (a = min(1, p/q)) or by the judge (J)."""
    a = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 1.0)
    R = (q * (1 - a) * (1 - J)).sum()
    r = np.maximum(p - q, 0.0)
    r = r / r.sum() if r.sum() > 0 else p
    return q * (a + (1 - a) * J) + R * r


# ---- drawing -----------------------------------------------------------------------------------------
def _control(**fields) -> LossyControl:
    spec = SpecConfig(drafter="ngram", accept_off_policy=True, **fields)
    model = SimpleNamespace(cfg=SimpleNamespace(hidden_size=H, num_layers=2, vocab_size=V))
    speculation = SimpleNamespace(names=["ngram"], by_name={"ngram": SimpleNamespace()}, learned=None)
    return LossyControl(spec, model, TinyTokenizer(), speculation)


def _drafts(q_rows: np.ndarray, seed: int) -> torch.Tensor:
    """x [R, K]: one draw per row and position from q_rows [R, K, V]."""
    rng = np.random.default_rng(seed)
    cdf = q_rows.cumsum(-1)
    u = rng.random(q_rows.shape[:2])[..., None]
    return torch.from_numpy((u > cdf).sum(-1).clip(max=V - 1))


def _run_lossy(ctl: LossyControl, x: torch.Tensor, q: torch.Tensor | None, hidden=None, routed=None, seed=0):
    """One verify of every row through LossyControl, as the engine does -> (emitted [R, K+1], accepted [R],
    sources, behaviour: per-row lists)."""
    R, K = x.shape
    logits = torch.from_numpy(np.log(P[:K + 1])).float().expand(R, K + 1, V).contiguous()
    batch = DraftBatch(torch.cat([torch.zeros(R, 1, dtype=torch.long), x], 1), torch.full((R,), K), True, q=q)
    gen = torch.Generator().manual_seed(seed)
    ctl.start([], PARAMS, gen)
    hiddens = {} if hidden is None else {ctl.final_layer: hidden}
    verdict = ctl.verify(logits, hiddens, batch, PARAMS, gen, routed or [False] * R)
    emitted = torch.cat([x, torch.zeros(R, 1, dtype=torch.long)], 1)
    emitted.scatter_(1, verdict.accepted[:, None], verdict.next_token[:, None])
    lps = logprobs_of(logits, emitted, PARAMS).tolist()  # the engine's record: node j predicts token j
    accepted = verdict.accepted.tolist()
    prov = ctl.provenance(_to_host(*verdict.columns), accepted, lps)  # the columns' host rows, as the engine's
    sources, behaviour = prov.sources, prov.behaviour
    return emitted.numpy(), np.array(accepted), sources, behaviour


# ---- checking ----------------------------------------------------------------------------------------
def check_law(cells: np.ndarray, recorded: np.ndarray, law: dict, wrong: dict | None = None) -> None:
    """cells [n]: a (context, token) cell per draw, recorded [n]: its recorded behaviour logprob, law:
    cell -> the test's own probability of that token in that context (per context summing to 1).
    wrong: cell -> the old record's probability, which the same chi-square must reject."""
    keys = sorted(law)
    got = np.array([law[c] for c in cells])
    assert np.allclose(np.exp(recorded), got, rtol=1e-4, atol=1e-6), "recorded law differs from the formula"
    counts, records = {c: 0 for c in keys}, {c: [] for c in keys}
    for c, r in zip(cells, recorded):
        counts[c] += 1
        records[c].append(r)
    assert all(counts[c] == 0 for c in keys if law[c] == 0), "a token of zero probability was emitted"
    live = [c for c in keys if law[c] > 0]
    contexts = {c[0] for c in live}
    n_ctx = {g: sum(counts[c] for c in live if c[0] == g) for g in contexts}
    rec = {c: float(np.exp(np.mean(records[c]))) if counts[c] else law[c] for c in live}
    for g in contexts:  # the records of one context form a distribution
        assert sum(rec[c] for c in live if c[0] == g) == pytest.approx(1.0, abs=1e-4)
    obs = np.array([counts[c] for c in live], dtype=float)
    _, p_right = chisquare(obs, _expected(live, rec, n_ctx))
    assert p_right > 0.01, f"counts do not match the recorded law (chi-square p = {p_right:.2e})"
    if wrong is not None:  # over every token the old record gives mass to, emitted or not
        if any(wrong[c] == 0 for c in live):  # it gives zero to a token that was emitted: rejected outright
            return
        cols = [c for c in keys if wrong[c] > 0 and c[0] in contexts]
        _, p_wrong = chisquare(np.array([counts[c] for c in cols], dtype=float), _expected(cols, wrong, n_ctx))
        assert p_wrong < 0.01, f"the old record (target p) is not rejected (chi-square p = {p_wrong:.2f})"


def _expected(cells, law: dict, n_ctx: dict) -> np.ndarray:
    tot = {g: sum(law[c] for c in cells if c[0] == g) for g in n_ctx}
    return np.array([n_ctx[c[0]] * law[c] / tot[c[0]] for c in cells])


def _position(emitted, accepted, behaviour, j: int, rows=None):
    """Rows that reached position j as a continuation of accepted drafts -> (rows, tokens, records)."""
    rows = np.arange(len(accepted)) if rows is None else rows
    rows = rows[accepted[rows] >= j]
    return rows, emitted[rows, j], np.array([behaviour[r][j] for r in rows])


def _cells(context, tokens) -> list[tuple[int, int]]:
    return [(int(c), int(t)) for c, t in zip(context, tokens)]


def _table(context, law_row: np.ndarray) -> dict:
    return {(context, y): float(law_row[y]) for y in range(V)}


# ---- judge rules that read p: sampled drafts ---------------------------------------------------------
@pytest.mark.parametrize("name,tau", RULES)
def test_judged_sampled_drafts_record_the_mixture_law(name, tau):
    for k in range(2):  # no target probability sits on the rule's boundary (float rounding could flip it)
        assert not np.isclose(P[k], bar(name, tau, P[k]), atol=2e-3).any()
    q = np.broadcast_to(Q, (ROWS, 2, V))
    x = _drafts(q, seed=1)
    ctl = _control(verification="judge", judge=name, judge_threshold=tau)
    emitted, accepted, sources, behaviour = _run_lossy(ctl, x, torch.from_numpy(q.copy()).float())
    assert sum(s.count(JUDGE) for s in sources) > ROWS // 10  # judge-kept tokens occurred
    assert (accepted == 2).sum() > ROWS // 10  # multi-token drafts occurred
    for j in range(2):
        J = rule(name, tau, P[j])
        assert (J & (Q[j] > P[j])).any()  # the judge keeps tokens the exact test would damp: m != p
        rows, tokens, rec = _position(emitted, accepted, behaviour, j)
        check_law(_cells([0] * len(rows), tokens), rec, _table(0, mixture(P[j], Q[j], J)), _table(0, P[j]))


# ---- the learned judge: point-mass drafts judged, sampled drafts verified exactly --------------------
def test_learned_judge_records_the_exact_law():
    """The learned head reads the state after the drafted token, so its verdict on tokens not drafted is
    unknown: it judges point-mass drafts (law: x with probability 1 if kept, else p) and leaves sampled
    drafts to the exact test (law p). Half the rows of each kind; a point-mass row's context is its draft."""
    ctl = _control(verification="judge", judge="learned", judge_threshold=0.5)
    g = torch.Generator().manual_seed(0)
    ctl.judge_head.add(torch.randn(300, H, generator=g), (torch.rand(300, generator=g) < 0.5).float())
    assert ctl.judge_head.ready
    embed = torch.randn(V, H, generator=g)  # h after token v: a function of v, as a model's state would be
    half = ROWS // 2
    ctx = np.arange(half) % V  # point-mass rows: draft (c, c + 1) in context c
    fixed = np.stack([ctx, (ctx + 1) % V], 1)
    q = np.concatenate([np.eye(V)[fixed], np.broadcast_to(Q, (half, 2, V))])
    x = torch.cat([torch.from_numpy(fixed), _drafts(q[half:], seed=2)])
    hidden = torch.cat([torch.zeros(ROWS, 1, H), embed[x]], 1)
    ctl.judge_head.train_every = 10 ** 9  # the head stays as it is while the verify banks examples
    scores = ctl.judge_head.score(embed).sort().values  # a threshold between two scores: keeps half the tokens
    ctl.spec.judge_threshold = tau = float(scores[V // 2 - 1] + scores[V // 2]) / 2
    emitted, accepted, sources, behaviour = _run_lossy(ctl, x, torch.from_numpy(q).float(), hidden, seed=3)
    J = (ctl.judge_head.score(embed) >= tau).numpy()
    assert 0 < J.sum() < V
    assert any(JUDGE in s for s in sources[:half]) and not any(JUDGE in s for s in sources[half:])
    for j in range(2):
        law, wrong = {}, {}
        for c in range(V):  # point masses: J(x) keeps x outright, otherwise the target's p
            xj = fixed[c, j]
            m = np.eye(V)[xj] if J[xj] else P[j]
            law.update(_table(c, m))
            wrong.update(_table(c, P[j]))
        law.update(_table(V, P[j]))  # sampled drafts: exact verification
        wrong.update(_table(V, P[j]))
        rows, tokens, rec = _position(emitted, accepted, behaviour, j)
        context = np.where(rows < half, rows % V, V)
        check_law(_cells(context, tokens), rec, law, wrong)


# ---- Arbitrage step routing --------------------------------------------------------------------------
def test_routed_steps_record_the_exact_law():
    """Deterministic steps (context c: the step (c, c + 2)), judged by `prob` where the likelihood router
    does not keep them, beside sampled steps, which a router may never keep (their law under a
    content-based choice is not computable): those are judged like any sampled draft."""
    tau_route, tau_judge = -0.9, 0.09
    ctl = _control(step_routing="arbitrage", route_threshold=tau_route, verification="judge", judge="prob",
                   judge_threshold=tau_judge)
    half = ROWS // 2
    ctx = np.arange(half) % V
    fixed = np.stack([ctx, (ctx + 2) % V], 1)
    q = np.concatenate([np.eye(V)[fixed], np.broadcast_to(Q, (half, 2, V))])
    x = torch.cat([torch.from_numpy(fixed), _drafts(q[half:], seed=4)])
    emitted, accepted, sources, behaviour = _run_lossy(ctl, x, torch.from_numpy(q).float(), routed=[True] * ROWS)
    entropy = -(P[:2] * np.log(P[:2])).sum(-1)
    kept = [np.mean(np.log(P[[0, 1], fixed[c]]) + entropy) >= tau_route for c in range(V)]
    assert 0 < sum(kept) < V  # the router keeps some steps and rejects others
    assert any(ROUTED in s for s in sources[:half]) and not any(ROUTED in s for s in sources[half:])
    assert any(JUDGE in s for s in sources)
    for j in range(2):
        J = rule("prob", tau_judge, P[j])
        law, wrong = {}, {}
        for c in range(V):
            xj = fixed[c, j]
            m = np.eye(V)[xj] if kept[c] else mixture(P[j], np.eye(V)[xj], J)
            law.update(_table(c, m))
            wrong.update(_table(c, P[j]))
        law.update(_table(V, mixture(P[j], Q[j], J)))
        wrong.update(_table(V, P[j]))
        rows, tokens, rec = _position(emitted, accepted, behaviour, j)
        context = np.where(rows < half, rows % V, V)
        check_law(_cells(context, tokens), rec, law, wrong)


# ---- lossless: the target's logprob is the law -------------------------------------------------------
def test_lossless_chain_records_the_targets_law():
    q = np.broadcast_to(Q, (ROWS, 2, V))
    x = _drafts(q, seed=5)
    logits = torch.from_numpy(np.log(P)).float().expand(ROWS, 3, V).contiguous()
    v = verify_chain(logits, x, torch.full((ROWS,), 2), PARAMS, torch.from_numpy(q.copy()).float(),
                     torch.Generator().manual_seed(6))
    emitted = torch.cat([x, torch.zeros(ROWS, 1, dtype=torch.long)], 1)
    emitted.scatter_(1, v.accepted[:, None], v.next_token[:, None])
    lps = logprobs_of(logits, emitted, PARAMS).numpy()  # what the engine records (rollout/engine.py: _fetch)
    accepted, emitted = v.accepted.numpy(), emitted.numpy()
    assert (accepted == 2).sum() > ROWS // 10 and (accepted == 0).sum() > ROWS // 10
    for j in range(2):
        rows = np.arange(ROWS)[accepted >= j]
        check_law(_cells([0] * len(rows), emitted[rows, j]), lps[rows, j], _table(0, P[j]))


def test_lossless_tree_records_the_targets_law():
    """Two root children drawn without replacement from q, each with one child of its own; the law of
    position 1 is p at the node the walk went through (contexts: node 1 or 2)."""
    PT = np.stack([P[0], P[1], P[2], P[2], P[2]])  # node 0 (root), nodes 1-2 (children), 3-4 (grandchildren)
    PT[2] = [.15, .15, .30, .10, .10, .20]
    logits = torch.from_numpy(np.log(PT)).float().expand(ROWS, 5, V).contiguous()
    g = torch.Generator().manual_seed(7)
    roots, root_q = sample_without_replacement(torch.from_numpy(Q[0]).float().expand(ROWS, V), 2, g)
    q2 = torch.from_numpy(Q[1]).float().expand(ROWS, V)
    grand = torch.stack([q2.multinomial(1, generator=g)[:, 0] for _ in range(2)], 1)
    tokens = torch.cat([torch.zeros(ROWS, 1, dtype=torch.long), roots, grand], 1)
    children = torch.tensor([[1, 2], [3, -1], [4, -1], [-1, -1], [-1, -1]]).expand(ROWS, 5, 2)
    q = torch.cat([torch.zeros(ROWS, 1, V), root_q, q2[:, None].expand(ROWS, 2, V)], 1)
    v = verify_tree(logits, tokens, children, PARAMS, q, torch.Generator().manual_seed(8))
    path, accepted = v.path.numpy(), v.accepted.numpy()
    emitted = np.concatenate([np.take_along_axis(tokens.numpy(), path.clip(min=0), 1), np.zeros((ROWS, 1), int)], 1)
    emitted[np.arange(ROWS), accepted] = v.next_token.numpy()
    at = np.concatenate([np.zeros((ROWS, 1), int), path.clip(min=0)], 1)  # the node predicting each position
    lps = logprobs_of(logits.gather(1, torch.from_numpy(at)[..., None].expand(-1, -1, V)),
                      torch.from_numpy(emitted), PARAMS).numpy()
    assert (path[:, 0] == 2).sum() > ROWS // 20 and (accepted == 2).sum() > ROWS // 20  # 2nd child, depth 2
    check_law(_cells([0] * ROWS, emitted[:, 0]), lps[:, 0], _table(0, PT[0]))
    rows = np.arange(ROWS)[accepted >= 1]
    law = {**_table(1, PT[1]), **_table(2, PT[2])}
    check_law(_cells(path[rows, 0], emitted[rows, 1]), lps[rows, 1], law)
