"""The recorded behaviour logprob is the law the whole pipeline emits a token with, by frequency.

Each test draws many seeded rollouts of the same one or two positions at once (one verify call over
ROWS identical rows: fixed target p and draft q, drafts drawn by the test), counts the emitted tokens
per position, and checks them three ways:
  - every row's recorded behaviour probability equals the law this file computes on its own with
    numpy, straight from the formula m(y) = q(y) [a(y) + (1 - a(y)) J(y)] + R r(y) (docs/lossy.md);
  - a chi-square test of the counts against the recorded probabilities passes (p > 0.01);
  - the same test rejects the old record, the target's own p(y) (p < 0.01), wherever the pipeline's
    law differs from it: the test can tell the subtle wrong variant from the right one.
Position 1 is read on the rows whose position 0 was an accepted draft (its law given that prefix).
Lossy modes go through LossyControl.verify and .behaviour, what the engine calls. The lossless chain and
tree run the engine itself on a small model and read the logprobs it returns: each is the target's own,
computed here by running the model, and the samples' frequencies fit the law those records define.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rlspec.rollout.lossy.control import LossyControl
from rlspec.rollout.lossy.judge import JUDGE, ROUTED
from rlspec.rollout.runtime.sampling import logprobs_of
from rlspec.rollout.runtime.transfers import host_rows
from rlspec.rollout.speculation.draft_batch import DraftBatch
from rlspec.rollout.types import SamplingParams, SpecConfig
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
    prov = ctl.provenance(host_rows(*verdict.columns), accepted, lps)  # the columns' host rows, as the engine's
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


# ---- lossless: the engine records the target's logprob, which is the law --------------------------------
LL_PROMPT, LL_LENGTH, LL_N, LL_PARAMS = [3, 4, 5, 1], 5, 1000, SamplingParams(temperature=0.8)


def _lossless_rollouts(width: int, monkeypatch):
    """LL_N rollouts of LL_LENGTH tokens of a 6-token law model through the engine, speculation forced on every
    step (OracleDrafter: drafts of 1-3 nodes along the target's likeliest path, some tokens random; width 2: the
    root's top-1 and top-2 children) -> (law model, results, exact law (sequences, probabilities), engine stats,
    sibling outcomes of verified nodes with two children)."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from tests.rollout.law_helpers import hf_exact_law, make_law_model, spy_siblings
    from tests.rollout.spec_helpers import OracleDrafter

    hf = make_law_model(V, seed=2)
    params = SamplingParams(temperature=LL_PARAMS.temperature, max_new_tokens=LL_LENGTH, n=LL_N, seed=0,
                            ignore_eos=True)
    seqs, probs, ranked = hf_exact_law(hf, LL_PROMPT, LL_LENGTH, params)
    seen = spy_siblings(monkeypatch)
    spec = SpecConfig(drafter="ngram", num_draft_tokens=3, tree_width=width, selector="always", online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[], max_num_seqs=LL_N,
                        drafter=OracleDrafter(ranked, V, corrupt=0.3, seed=width))
    results = eng.generate([LL_PROMPT], params)
    return hf, results, (seqs, probs), eng.stats(), seen


def _target_logprobs(hf, completions: list[list[int]]) -> dict:
    """prefix (tuple) -> float64 log softmax(logits / T) of the model run here on prompt + prefix, for every prefix
    of the completions: the target's own logprobs, computed apart from the engine."""
    prefixes = sorted({tuple(c[:j]) for c in completions for j in range(len(c))}, key=len)
    out = {}
    for n in sorted({len(p) for p in prefixes}):
        batch = [p for p in prefixes if len(p) == n]
        with torch.no_grad():
            logits = hf(torch.tensor([LL_PROMPT + list(p) for p in batch])).logits[:, -1].double()
        out.update(zip(batch, torch.log_softmax(logits / LL_PARAMS.temperature, -1)))
    return out


def _check_lossless_record(hf, results, law) -> None:
    """Every token's recorded logprob (and behaviour logprob: lossless, the same) is the target's own, as the test
    computes it; the records define the law the samples are drawn from: the joint record of each sample is its
    sequence's exact probability, and the samples' frequencies fit that law (chi-square, every sequence kept)."""
    from tests.rollout.law_helpers import ALPHA, sequence_pvalue

    completions = [r.completion_ids for r in results]
    target = _target_logprobs(hf, completions)
    want = torch.tensor([[float(target[tuple(c[:j])][t]) for j, t in enumerate(c)] for c in completions],
                        dtype=torch.float64)
    got = torch.tensor([r.logprobs for r in results], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert all(r.behaviour_logprobs == r.logprobs for r in results)
    seqs, probs = law
    index = {tuple(q): i for i, q in enumerate(seqs.tolist())}
    exact = probs[[index[tuple(c)] for c in completions]]
    torch.testing.assert_close(got.sum(1).exp(), exact, rtol=1e-3, atol=0)
    assert sequence_pvalue(torch.tensor(completions), seqs, probs) > ALPHA


def test_lossless_chain_records_the_targets_law(monkeypatch):
    """Chains verified by the CPU kernel where it is built (it returns the logprobs it drew with), else by the
    torch rule and logprobs_of: drafts accepted in full (the bonus after them) and cut short."""
    hf, results, law, stats, _ = _lossless_rollouts(1, monkeypatch)
    assert stats["rollout/accept_hist/3"] >= 0.02 and stats["rollout/accept_hist/0"] >= 0.1, stats
    _check_lossless_record(hf, results, law)


def test_lossless_tree_records_the_targets_law(monkeypatch):
    """Trees: the logprob of each token is read at the node that predicted it on the accepted path, a later
    sibling's when the first child was rejected; paths two deep accepted."""
    hf, results, law, stats, seen = _lossless_rollouts(2, monkeypatch)
    assert min(seen["first"], seen["later"], seen["none"]) >= 50, seen
    assert stats["rollout/accept_hist/2"] >= 0.02, stats
    _check_lossless_record(hf, results, law)
