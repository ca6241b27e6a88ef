"""The lossless law with a repetition penalty and min-p on, with top-k / top-p, under chains and trees.

Same harness as test_law.py: N = 10k completions of LENGTH = 5 tokens, speculation on every decode
step, the joint law of all 5 tokens compared (chi-square, ALPHA) with the exact law computed by
transformers alone: the HF model's forward on every prefix and its own processors
(RepetitionPenaltyLogitsProcessor over prompt + prefix, then temperature, top-k/top-p, min-p). With a
vocabulary of 8 and a penalty of 1.5 the penalty reshapes most positions, so a node judged against the
wrong history shifts the law far beyond the test's resolution: the wrong variants at the end (drafts
before position j left out of its history; the history never updated after the prompt) fail the very
test the engine passes. Each test also proves the path it names ran (multi-token drafts accepted in
full, sibling children tried after a rejection).
"""
import pytest
import torch

import rlspec.rollout.runtime.history as history
from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
from rlspec.rollout.types import SamplingParams
from tests.rollout.law_helpers import (ALPHA, engine_samples, hf_exact_law, make_law_model, one_thread,  # noqa: F401
                                       sequence_pvalue, spy_siblings)
from tests.rollout.spec_helpers import OracleDrafter

# a prompt of few distinct tokens: most drafted tokens are new to the history, so a node judged without
# the drafts before it is judged against the wrong law (with [3, 4, 5, 1] the flaw only reached p = 0.05)
VOCAB, PROMPT, LENGTH, N = 8, [3, 3, 1], 5, 10_000
TOP_K = SamplingParams(temperature=0.8, top_k=5, min_p=0.1, repetition_penalty=1.5)
TOP_P = SamplingParams(temperature=0.9, top_p=0.9, min_p=0.05, repetition_penalty=1.5)
_LAWS: dict = {}


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


@pytest.fixture(scope="module")
def hf():
    return make_law_model(VOCAB, seed=0, std=0.3)


def exact(hf, params, length=LENGTH):
    """(sequences [S, length], probabilities [S], prefix -> ranked next tokens), cached per setting."""
    key = (id(hf), params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty, length)
    if key not in _LAWS:
        _LAWS[key] = hf_exact_law(hf, PROMPT, length, params)
    return _LAWS[key]


def pvalue(hf, params, drafter_for, width, k, length=LENGTH):
    samples, stats = engine_samples(hf, PROMPT, params, N, length, drafter_for, width, k)
    seqs, probs, _ = exact(hf, params, length)
    return sequence_pvalue(samples, seqs, probs), stats


def full_share(stats, depth: int) -> float:
    return stats.get(f"rollout/accept_hist/{depth}", 0.0)


def test_the_penalty_changes_the_law(hf):
    """Otherwise the tests below could not tell a missing penalty from a correct one."""
    seqs, probs, _ = exact(hf, TOP_K)
    plain = SamplingParams(temperature=TOP_K.temperature, top_k=TOP_K.top_k, min_p=TOP_K.min_p)
    seqs0, probs0, _ = exact(hf, plain)
    law = dict(zip(map(tuple, seqs.tolist()), probs.tolist()))
    law0 = dict(zip(map(tuple, seqs0.tolist()), probs0.tolist()))
    assert sum(abs(law.get(s, 0) - law0.get(s, 0)) for s in set(law) | set(law0)) > 0.2


def test_model_free_chains_keep_the_law(hf):
    """Deterministic chains (one-hot q), ragged 1..3: node j's p is penalised over the drafts before it."""
    drafter = OracleDrafter(exact(hf, TOP_K)[2], VOCAB, corrupt=0.2, seed=1)
    p, stats = pvalue(hf, TOP_K, lambda runtime: drafter, width=1, k=3)
    assert p > ALPHA, p
    assert drafter.multi >= N // 2
    assert full_share(stats, 3) >= 0.01 and full_share(stats, 2) >= 0.05, stats


def test_model_free_trees_keep_the_law(hf, monkeypatch):
    """Deterministic trees: each node's history is its own path, not its siblings' tokens (3 nodes: a
    branch of two below the root's first child, one token below its second)."""
    seen = spy_siblings(monkeypatch)
    drafter = OracleDrafter(exact(hf, TOP_P)[2], VOCAB, corrupt=0.2, seed=2)
    p, stats = pvalue(hf, TOP_P, lambda runtime: drafter, width=2, k=3)
    assert p > ALPHA, p
    assert drafter.branched >= N // 2
    assert full_share(stats, 2) >= 0.02, stats
    assert min(seen["first"], seen["later"], seen["none"]) >= 1000, seen


def test_eagle3_sampled_chains_keep_the_law(hf, monkeypatch):
    """The learned drafter samples chains from q penalised over the same histories: min(1, p/q), residuals.
    Its q at draft position d is penalised over the row's tokens plus its drafts 0..d-1 (spied), the
    history the target's node d is judged against, so q stays close to p."""
    drafts = []  # per _draft call: the (seen, tokens) of each of its picks, root first
    real_draft, real_pick = Eagle3Drafter._draft, Eagle3Drafter._pick

    def spy_draft(self, *a):
        drafts.append([])
        return real_draft(self, *a)

    def spy_pick(self, h, k, ids, seen=None, u=None):
        out = real_pick(self, h, k, ids, seen, u)
        drafts[-1].append((seen.clone(), out[0].clone()))
        return out

    monkeypatch.setattr(Eagle3Drafter, "_draft", spy_draft)
    monkeypatch.setattr(Eagle3Drafter, "_pick", spy_pick)
    p, stats = pvalue(hf, TOP_K, lambda runtime: Eagle3Drafter(runtime), width=1, k=3)
    assert p > ALPHA, p
    assert full_share(stats, 3) >= 0.005 and full_share(stats, 2) >= 0.03, stats
    # the call's first draft: every row holds the prompt {1, 3} and its first token, nothing else
    root = drafts[0][0][0]
    assert root[:, [1, 3]].all() and (root.sum(-1) <= 3).all()
    for picks in drafts:  # each later pick's history: the previous one's plus the token it drew
        for (seen, tok), (nxt, _) in zip(picks, picks[1:]):
            assert torch.equal(nxt, seen.scatter(1, tok[:, :1], True))
    assert sum(len(picks) >= 3 for picks in drafts) >= 1


def test_eagle3_sampled_trees_keep_the_law(hf, monkeypatch):
    """Two root children drawn without replacement, each continued one more token along its own branch:
    the second token's history holds its own branch's first token, not its sibling's."""
    seen = spy_siblings(monkeypatch)
    # 6 tokens: a draft's cap is the tokens left minus one, and 2 x 2 nodes need 5 left after the first
    p, stats = pvalue(hf, TOP_K, lambda runtime: Eagle3Drafter(runtime), width=2, k=4, length=6)
    assert p > ALPHA, p
    assert full_share(stats, 2) >= 0.01, stats
    assert min(seen["first"], seen["later"], seen["none"]) >= 500, seen


def _row_history_only(self, tokens, tree_mask):
    """Wrong: every node sees the row's committed tokens only, not the drafts before it."""
    B, N1 = tokens.shape
    return self.seen[:B, None, :self.vocab].expand(B, N1, self.vocab)


REAL_AT_NODES = history.TokenHistory.at_nodes


def _siblings_seen(self, tokens, tree_mask):
    """Wrong for trees: every node sees all nodes listed before it, its siblings' branches included."""
    return REAL_AT_NODES(self, tokens, None)


@pytest.mark.parametrize("flaw", ["drafts_left_out", "never_updated", "siblings_seen"])
def test_wrong_histories_are_caught(hf, monkeypatch, flaw):
    """Each flaw is one wrong history, in the same test the engine passes (same seed, N, ALPHA)."""
    if flaw == "drafts_left_out":
        monkeypatch.setattr(history.TokenHistory, "at_nodes", _row_history_only)
    elif flaw == "never_updated":  # the prompt's tokens only: committed tokens never join the history
        monkeypatch.setattr(history.TokenHistory, "mark", lambda self, rows, tokens, keep=None: None)
    else:
        monkeypatch.setattr(history.TokenHistory, "at_nodes", _siblings_seen)
    params, seed, width = (TOP_P, 2, 2) if flaw == "siblings_seen" else (TOP_K, 1, 1)
    drafter = OracleDrafter(exact(hf, params)[2], VOCAB, corrupt=0.2, seed=seed)
    p, _ = pvalue(hf, params, lambda runtime: drafter, width=width, k=3)
    assert p <= ALPHA, p
