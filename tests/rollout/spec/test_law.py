"""The engine's samples have exactly the target's law, whatever drafts and trees speculation used.

Each test draws 10k completions of 5 tokens from the engine with speculation forced on every decode
step (selector "always") and compares the joint law of all 5 tokens with the exact one, computed
from transformers alone (tests/rollout/law_helpers.py: HF forward + HF warpers, every sequence of
positive probability enumerated). The window covers every emitted token: the first comes from the
prefill, and a draft is capped at the tokens still allowed minus one, so the token after a fully
accepted draft (the bonus) always lies inside it. Each test also proves the path it names ran:
multi-token drafts accepted in full, several children at a node, later siblings accepted.
"""
from collections import Counter

import pytest
import torch

import rollout.spec.verify as verify
from rollout.engine import RolloutEngine
from rollout.runtime.model import loader
from rollout.spec.drafters.eagle3 import Eagle3Drafter
from rollout.types import SamplingParams, SpecConfig
from tests.rollout.law_helpers import ALPHA, hf_exact_law, make_law_model, sequence_pvalue
from tests.rollout.spec_helpers import OracleDrafter

VOCAB, PROMPT, LENGTH, N = 8, [3, 4, 5, 1], 5, 10_000
TOP_K = SamplingParams(temperature=0.7, top_k=3)
TOP_P = SamplingParams(temperature=0.9, top_p=0.9)
T1 = SamplingParams(temperature=1.0)
_LAWS: dict = {}


@pytest.fixture(scope="module")
def hf():
    return make_law_model(VOCAB, seed=0, std=0.3)


def exact(hf, params):
    key = (params.temperature, params.top_k, params.top_p)
    if key not in _LAWS:
        _LAWS[key] = hf_exact_law(hf, PROMPT, LENGTH, params)
    return _LAWS[key]


def sample_engine(hf, params, drafter=None, width=1, k=3, tree_draws="without_replacement", seed=0):
    """N completions of PROMPT with the given drafter (None: the learned eagle3, cold) forced on every
    step -> (samples [N, LENGTH] long, engine stats)."""
    runtime = loader.from_hf_model(hf)
    if drafter is None:
        drafter = Eagle3Drafter(runtime, tree_draws=tree_draws)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=k, tree_width=width, selector="always",
                      online_training=False)
    eng = RolloutEngine(runtime, None, spec=spec, eos_token_ids=[], max_num_seqs=N, drafter=drafter)
    eng.selector.costs.table[(1, 1)] = 1.0  # "always" never reads costs: skip calibrating 10k rows
    run = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                         max_new_tokens=LENGTH, n=N, seed=seed, ignore_eos=True)
    out = eng.generate([PROMPT], run)
    return torch.tensor([r.completion_ids for r in out]), eng.stats()


@pytest.fixture
def siblings(monkeypatch):
    """Counts, over every node verified with several children, which child was accepted
    ("first", "later") or that all were rejected ("none")."""
    seen, real = Counter(), verify._recursive_reject

    def spy(p, xs, qs, valid, generator):
        slot, rest = real(p, xs, qs, valid, generator)
        several = valid.sum(-1) >= 2
        seen["first"] += int((several & (slot == 0)).sum())
        seen["later"] += int((several & (slot > 0)).sum())
        seen["none"] += int((several & (slot < 0)).sum())
        return slot, rest

    monkeypatch.setattr(verify, "_recursive_reject", spy)
    return seen


def assert_law(hf, params, samples):
    seqs, probs, _ = exact(hf, params)
    assert samples.shape == (N, LENGTH)
    p = sequence_pvalue(samples, seqs, probs)
    assert p > ALPHA, p


def assert_full_acceptance(stats, depth: int, share: float = 0.02):
    """Drafts of `depth` tokens were accepted in full (so a bonus token followed) in >= share of verifies."""
    assert stats.get(f"rollout/accept_hist/{depth}", 0.0) >= share, stats


def assert_siblings(seen, total: int = 300):
    """Later siblings were accepted after an earlier one was rejected, and whole nodes were rejected."""
    assert seen["later"] >= total and seen["none"] >= total and seen["first"] >= total, seen


@pytest.mark.parametrize("params", [TOP_K, TOP_P], ids=["T0.7-top_k3", "T0.9-top_p0.9"])
def test_oracle_chains_keep_the_law(hf, params):
    """A model-free deterministic drafter (one-hot q), ragged chains of 1..3 tokens."""
    drafter = OracleDrafter(exact(hf, params)[2], VOCAB, corrupt=0.2, seed=1)
    samples, stats = sample_engine(hf, params, drafter, width=1, k=3)
    assert_law(hf, params, samples)
    assert drafter.multi >= N // 2
    assert_full_acceptance(stats, 3)


@pytest.mark.parametrize("params", [TOP_K, TOP_P], ids=["T0.7-top_k3", "T0.9-top_p0.9"])
def test_oracle_trees_keep_the_law(hf, params, siblings):
    """Deterministic trees: the root's top-1 and top-2 (one-hot rule, running p with rejected
    children removed), each continued down the oracle's path."""
    drafter = OracleDrafter(exact(hf, params)[2], VOCAB, corrupt=0.2, seed=2)
    samples, stats = sample_engine(hf, params, drafter, width=2, k=2)
    assert_law(hf, params, samples)
    assert drafter.branched >= N // 2
    assert_full_acceptance(stats, 2)
    assert_siblings(siblings)


@pytest.mark.parametrize("params", [TOP_K, TOP_P], ids=["T0.7-top_k3", "T0.9-top_p0.9"])
def test_eagle3_chains_keep_the_law(hf, params):
    """The learned drafter samples its chains from q (processed like p): min(1, p/q) and residuals."""
    samples, stats = sample_engine(hf, params, width=1, k=3)
    assert_law(hf, params, samples)
    assert_full_acceptance(stats, 3, share=0.01)
    assert stats["rollout/accept_hist/2"] >= 0.02


@pytest.mark.parametrize("draws", ["without_replacement", "iid"])
@pytest.mark.parametrize("params", [TOP_K, TOP_P, T1], ids=["T0.7-top_k3", "T0.9-top_p0.9", "T1"])
def test_eagle3_trees_keep_the_law(hf, params, draws, siblings):
    """Sampled trees: 3 root children drawn without replacement (recursive rejection sampling) or
    i.i.d. (SpecInfer) from q, each verified against the running residual."""
    samples, stats = sample_engine(hf, params, width=3, k=1, tree_draws=draws)
    assert_law(hf, params, samples)
    assert_full_acceptance(stats, 1, share=0.3)
    assert_siblings(siblings)
