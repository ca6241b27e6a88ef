"""The engine's samples have exactly the target's law, whatever drafts and trees speculation used.

Each test draws N = 10k completions of LENGTH = 5 tokens from the engine with speculation forced on
every decode step (selector "always") and compares the joint law of all 5 tokens with the exact one
computed by transformers alone (tests/rollout/law_helpers.py: HF forward and HF warpers over every
sequence of positive probability) at the suite's threshold ALPHA. The window is every emitted
token: the first comes from the prefill, and a draft is capped at the tokens still allowed minus
one, so the token after a fully accepted draft (the bonus) always lies inside it. Each test also
proves that the path it names ran: drafts accepted in full, later siblings accepted after a
rejected one, nodes whose children were all rejected.

Sampling settings (T < 1 with top-k, and with top-p), drafters (a model-free deterministic one and
the learned eagle3 sampling its drafts) and shapes (chains, trees) are all covered; eagle3, ten
times dearer per run, covers them pairwise. Trees at T = 1 and the rule for children drawn without
replacement have their own engine-level tests in test_rsd.py.
"""
import pytest
import torch

from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
from rlspec.rollout.types import SamplingParams
from tests.rollout.law_helpers import (ALPHA, engine_samples, hf_exact_law, make_law_model, one_thread,  # noqa: F401
                                       sequence_pvalue, spy_siblings)
from tests.rollout.spec_helpers import OracleDrafter

VOCAB, PROMPT, LENGTH, N = 8, [3, 4, 5, 1], 5, 10_000
DRAFT_VOCAB = [0, 2, 3, 5, 6]  # not a prefix of the ids: q must land on these, not on 0..4
TOP_K = SamplingParams(temperature=0.7, top_k=3)
TOP_P = SamplingParams(temperature=0.9, top_p=0.9)  # at T 0.8 one prefix's cumulative mass sits 5e-5 from 0.1
_LAWS: dict = {}


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


@pytest.fixture(scope="module")
def hf():
    return make_law_model(VOCAB, seed=0, std=0.3)


def exact(hf, params):
    """(sequences [S, LENGTH], probabilities [S], prefix -> ranked next tokens), cached per setting."""
    key = (id(hf), params.temperature, params.top_k, params.top_p)
    if key not in _LAWS:
        _LAWS[key] = hf_exact_law(hf, PROMPT, LENGTH, params)
    return _LAWS[key]


def check(hf, params, drafter_for, width, k, **engine_kw):
    """Sample through the engine, assert the law; returns the engine stats."""
    samples, stats = engine_samples(hf, PROMPT, params, N, LENGTH, drafter_for, width, k, **engine_kw)
    seqs, probs, _ = exact(hf, params)
    p = sequence_pvalue(samples, seqs, probs)
    assert p > ALPHA, p
    return stats


def full_share(stats, depth: int) -> float:
    """Share of verifies that accepted `depth` drafts: drafts that long accepted in full, then a bonus."""
    return stats.get(f"rollout/accept_hist/{depth}", 0.0)


@pytest.mark.parametrize("params", [TOP_K, TOP_P], ids=["T0.7-top_k3", "T0.9-top_p0.9"])
def test_model_free_chains_keep_the_law(hf, params):
    """Deterministic drafts (one-hot q): accept with p(x), else sample p with x removed; ragged 1..3."""
    drafter = OracleDrafter(exact(hf, params)[2], VOCAB, corrupt=0.2, seed=1)
    stats = check(hf, params, lambda runtime: drafter, width=1, k=3)
    assert drafter.multi >= N // 2
    assert full_share(stats, 3) >= 0.01 and full_share(stats, 2) >= 0.05, stats


@pytest.mark.parametrize("params", [TOP_K, TOP_P], ids=["T0.7-top_k3", "T0.9-top_p0.9"])
def test_model_free_trees_keep_the_law(hf, params, monkeypatch):
    """Deterministic trees: the root's top-1 and top-2 tried in turn against p with rejected children
    removed, each continued down the oracle's path (cap 3: depths 2 and 1)."""
    seen = spy_siblings(monkeypatch)
    drafter = OracleDrafter(exact(hf, params)[2], VOCAB, corrupt=0.2, seed=2)
    stats = check(hf, params, lambda runtime: drafter, width=2, k=2)
    assert drafter.branched >= N // 2
    assert full_share(stats, 2) >= 0.02, stats
    assert min(seen["first"], seen["later"], seen["none"]) >= 1000, seen


@pytest.mark.parametrize("width,k", [(1, 3), (2, 2)], ids=["chain", "tree"])
def test_compiled_steps_keep_the_law(hf, width, k, monkeypatch):
    """The same law when the target's steps run compiled (rollout/runtime/compiled.py): every verify went
    through the compiled layer (counted), multi-token drafts were accepted, and trees branched."""
    from rlspec.rollout.runtime.compiled import CompiledRunner

    calls = {"T>1": 0}
    runners = []
    run = CompiledRunner.run

    def counted(self, tokens, *a, **kw):
        calls["T>1"] += tokens.shape[1] > 1
        runners.append(self)
        return run(self, tokens, *a, **kw)

    monkeypatch.setattr(CompiledRunner, "run", counted)
    monkeypatch.setattr(CompiledRunner, "CPU_EVERY_SHAPE", True)  # every shape compiled, as on CUDA
    # no warm-up: it compiles the one-row graphs, which no step of this 10,000-row call takes (4 of 10 graphs)
    monkeypatch.setattr(CompiledRunner, "warm", lambda self, Ts, rows: None)
    drafter = OracleDrafter(exact(hf, TOP_P)[2], VOCAB, corrupt=0.2, seed=3)
    stats = check(hf, TOP_P, lambda runtime: drafter, width=width, k=k, compile_mode="on")
    assert calls["T>1"] >= 2 and runners[-1].counts["eager"] == 0  # every verify ran compiled
    assert full_share(stats, k) >= 0.01, stats
    assert (drafter.branched if width > 1 else drafter.multi) >= N // 2


def test_eagle3_sampled_chains_keep_the_law(hf):
    """The learned drafter samples chains from q (processed like p): min(1, p/q) and residuals."""
    stats = check(hf, TOP_P, lambda runtime: Eagle3Drafter(runtime), width=1, k=3)
    assert full_share(stats, 3) >= 0.005 and full_share(stats, 2) >= 0.03, stats


@pytest.mark.parametrize("width,k", [(1, 3), (3, 1)], ids=["chain", "tree"])
def test_eagle3_with_a_draft_vocabulary_keeps_the_law(hf, width, k, monkeypatch):
    """A draft vocabulary of 5 of the 8 tokens: q is sampled over those 5 and spread over the 8 for
    verification; tokens outside it come only from residuals and bonuses. Chains, and trees whose three
    root children are drawn without replacement: a later child was accepted after the first was rejected
    (its q has the earlier draws removed), and every child rejected (the residual after all three)."""
    seen = spy_siblings(monkeypatch)

    def drafter(runtime):
        d = Eagle3Drafter(runtime, draft_vocab_size=5)
        d.model.set_draft_vocab(torch.tensor(DRAFT_VOCAB))
        return d

    stats = check(hf, TOP_K, drafter, width=width, k=k)
    if width == 1:
        assert full_share(stats, 3) >= 0.005 and full_share(stats, 2) >= 0.03, stats
    else:
        assert full_share(stats, 1) >= 0.2, stats
        assert min(seen["first"], seen["later"], seen["none"]) >= 500, seen


@pytest.mark.parametrize("params,draws", [(TOP_K, "without_replacement"), (TOP_P, "iid")],
                         ids=["T0.7-top_k3-without_replacement", "T0.9-top_p0.9-iid"])
def test_eagle3_sampled_trees_keep_the_law(hf, params, draws, monkeypatch):
    """Three root children sampled from q, without replacement (recursive rejection sampling) or
    i.i.d. (SpecInfer), each tried against the running residual."""
    seen = spy_siblings(monkeypatch)
    stats = check(hf, params, lambda runtime: Eagle3Drafter(runtime, tree_draws=draws), width=3, k=1)
    assert full_share(stats, 1) >= 0.2, stats
    assert min(seen["first"], seen["later"], seen["none"]) >= 1000, seen
