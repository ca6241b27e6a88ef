"""Speculative decoding in the engine is exact: greedy output equals speculation off and transformers."""
import pytest
import torch

from rollout.engine import RolloutEngine
from rollout.runtime.model import loader
from rollout.types import SamplingParams, SpecConfig
from tests.conftest import TINY_VOCAB, make_tiny_hf, random_prompts
from tests.rollout.spec_helpers import ScriptedDrafter


def spec_engine(hf, drafter, width=1, k=4, **kw):
    spec = SpecConfig(drafter="ngram", num_draft_tokens=k, tree_width=width, max_spec_batch=10_000)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], drafter=drafter, **kw)
    eng.speculation.force(_arm(eng))  # always speculate: exactness must hold for every arm
    return eng


def _arm(eng):
    from rollout.speculation.selectors.longtail import Arm

    return Arm("scripted", eng.spec.num_draft_tokens, eng.spec.tree_width)


def reference(hf, prompts, params):
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2])
    return [r.completion_ids for r in eng.generate(prompts, params)]


def oracle_from(ref_by_prompt):
    def oracle(seq, n):
        ref = ref_by_prompt[seq.prompt_index]
        return ref[len(seq.completion_ids):len(seq.completion_ids) + n]
    return oracle


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_greedy_exact_with_speculation(kind, width, batch):
    hf = make_tiny_hf(kind, seed=batch)
    prompts = random_prompts(batch, 2, 30, seed=batch)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    ref = reference(hf, prompts, params)
    drafter = ScriptedDrafter(TINY_VOCAB, oracle_from(ref), corrupt=0.3, seed=batch, tree=width > 1)
    eng = spec_engine(hf, drafter, width=width, k=4)
    got = [r.completion_ids for r in eng.generate(prompts, params)]
    assert got == ref
    stats = eng.stats()
    assert stats["rollout/accept_len"] > 1.0  # speculation really happened and was accepted
    if batch > 1:
        assert stats["rollout/accept_rate"] < 1.0  # and rejections happened too


def test_eos_inside_accepted_drafts_stops_there():
    """Drafts running past EOS: the sample ends at EOS exactly as without speculation."""
    hf = make_tiny_hf("llama", seed=11)
    prompts = random_prompts(8, 2, 10, seed=11)
    params = SamplingParams(temperature=0, max_new_tokens=30)
    ref = reference(hf, prompts, params)

    def oracle(seq, n):  # the true continuation, then EOS, then junk: EOS lands inside drafts
        r = ref[seq.prompt_index][len(seq.completion_ids):]
        return (r + [2, 5, 6, 7])[:n]

    eng = spec_engine(hf, ScriptedDrafter(TINY_VOCAB, oracle, corrupt=0.0), k=6)
    # make the reference stop early by declaring a frequent token a stop token
    stop = max(set(sum(ref, [])), key=sum(ref, []).count)
    params_stop = SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=[stop])
    assert [r.completion_ids for r in eng.generate(prompts, params_stop)] == reference(hf, prompts, params_stop)
    assert eng.speculation.by_name["scripted"].finished == len(prompts)


def test_n_samples_and_row_limit_with_speculation():
    hf = make_tiny_hf("qwen2", seed=3)
    prompts = random_prompts(5, 3, 12, seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=25, n=3)
    ref = reference(hf, prompts, params)
    eng = spec_engine(hf, ScriptedDrafter(TINY_VOCAB, oracle_from(ref[::3]), corrupt=0.2), max_num_seqs=6)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref


def test_float32_greedy_matches_transformers_with_speculation():
    hf = make_tiny_hf("llama", seed=5)
    prompts = random_prompts(4, 3, 18, seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    ref = reference(hf, prompts, params)
    eng = spec_engine(hf, ScriptedDrafter(TINY_VOCAB, oracle_from(ref), corrupt=0.4), width=2)
    for r, p in zip(eng.generate(prompts, params), prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=0)
        hf_ids = out[0, len(p):].tolist()
        assert r.completion_ids == (hf_ids[:hf_ids.index(2) + 1] if 2 in hf_ids else hf_ids)


@pytest.mark.parametrize("temperature,top_p,width", [(1.0, 1.0, 1), (0.7, 0.8, 1), (1.0, 1.0, 2)])
def test_sampled_law_unchanged_by_speculation(temperature, top_p, width):
    """Joint law of the first three tokens with speculation equals the target's (chi-square)."""
    from scipy.stats import chisquare

    hf = make_tiny_hf("llama", vocab=6, seed=2)
    prompt = [3, 4, 5, 1]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=3, n=3000, seed=0,
                            ignore_eos=True)
    drafter = ScriptedDrafter(6, None, corrupt=1.0, tree=width > 1)  # uniform random proposals
    eng = spec_engine(hf, drafter, width=width, k=3, max_num_seqs=3000)
    eng.eos_token_ids = set()
    counts = {}
    for r in eng.generate([prompt], params):
        counts[tuple(r.completion_ids)] = counts.get(tuple(r.completion_ids), 0) + 1
    exact = exact_joint(hf, prompt, 3, params)
    keys = [k for k, p in exact.items() if p * 3000 > 5]
    obs = [counts.get(k, 0) for k in keys]
    exp = [exact[k] for k in keys]
    exp = [e * sum(obs) / sum(exp) for e in exp]
    assert chisquare(obs, exp).pvalue > 1e-3
    assert eng.stats()["rollout/accept_rate"] > 0.05


def exact_joint(hf, prompt, length, params) -> dict:
    """Exact law of `length` sampled tokens under temperature/top-p (enumerates the vocabulary)."""
    from rollout.runtime.sampling import probs_from_logits

    law = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, pr in law.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1].float()
            probs = probs_from_logits(logits, params)
            for t, q in enumerate(probs.tolist()):
                if q > 0:
                    nxt[prefix + (t,)] = pr * q
        law = nxt
    return law


def test_spec_logprobs_are_target_logprobs():
    hf = make_tiny_hf("llama", seed=8)
    prompt = random_prompts(1, 6, 6, seed=8)[0]
    params = SamplingParams(temperature=0.8, max_new_tokens=24, seed=3, ignore_eos=True)
    eng = spec_engine(hf, ScriptedDrafter(TINY_VOCAB, None, corrupt=1.0), width=1, k=4)
    r = eng.generate([prompt], params)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + r.completion_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4)


@pytest.mark.parametrize("selector", ["fixed", "adaptive"])
def test_auto_drafters_and_selectors_are_exact(selector):
    """Real drafters (suffix, n-gram, cold EAGLE-3) under either selector: arms change, output does not."""
    hf = make_tiny_hf("llama", seed=13)
    prompts = random_prompts(4, 3, 16, seed=13)
    params = SamplingParams(temperature=0, max_new_tokens=40, n=3)
    spec = SpecConfig(drafter="auto", num_draft_tokens=4, selector=selector, online_training=False,
                      max_spec_batch=None)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    for _ in range(2):  # the second call has the first call's rollouts in the suffix index
        assert [r.completion_ids for r in eng.generate(prompts, params)] == reference(hf, prompts, params)
    assert "strategy/explore_share" in eng.stats()


def test_adaptive_selector_keeps_the_sampled_law(monkeypatch):
    """The bandit switches drafters and shapes step by step; the law must not notice."""
    from scipy.stats import chisquare

    # A fake clock (every reading 1 ms later) makes every forward cost the same, and drafting is reported
    # free, so speculation always looks worth it and the selector really does move between arms, whatever
    # the machine load.
    from rollout.speculation.speculation import Speculation

    ticks = iter(range(10**9))
    monkeypatch.setattr("time.perf_counter", lambda: next(ticks) * 1e-3)
    observe = Speculation.observe_step
    monkeypatch.setattr(Speculation, "observe_step", lambda self, arm, batch, seconds, draft_seconds, *a:
                        observe(self, arm, batch, seconds, 0.0, *a))

    hf = make_tiny_hf("llama", vocab=6, seed=2)
    prompt = [3, 4, 5, 1, 3, 4]
    # 50 groups of 60 through 60 rows: small live batches, where the selector does speculate
    params = SamplingParams(temperature=1.0, max_new_tokens=3, n=60, seed=0, ignore_eos=True)
    spec = SpecConfig(drafter="auto", num_draft_tokens=3, selector="adaptive", online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[], max_num_seqs=60)
    counts = {}
    for r in eng.generate([prompt] * 50, params):
        counts[tuple(r.completion_ids)] = counts.get(tuple(r.completion_ids), 0) + 1
    exact = exact_joint(hf, prompt, 3, params)
    keys = [k for k, p in exact.items() if p * 3000 > 5]
    obs = [counts.get(k, 0) for k in keys]
    exp = [exact[k] * sum(obs) / sum(exact[k] for k in keys) for k in keys]
    assert chisquare(obs, exp).pvalue > 1e-3
    assert eng.stats()["rollout/spec_step_share"] > 0.2  # the law was tested under speculation


def test_forced_arm_overrides_the_selector_for_a_block_and_hands_back():
    """Speculation.forced(arm): every step uses `arm` (OFF: plain decoding) inside the block, the
    cache slack follows a forced arm larger than any the selector offers, and the choice returns
    to the selector afterwards; output stays exact either way."""
    from rollout.speculation.selectors.base import OFF, Arm

    hf = make_tiny_hf("llama", seed=11)
    prompts = random_prompts(3, 4, 9, seed=11)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    ref = reference(hf, prompts, params)
    oracle = oracle_from({i: r for i, r in enumerate(ref)})
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2],
                        spec=SpecConfig(drafter="ngram", selector="always", num_draft_tokens=2),
                        drafter=ScriptedDrafter(TINY_VOCAB, oracle, corrupt=0.0))
    spec = eng.speculation
    with spec.forced(OFF):
        assert spec.choose(4) == OFF
        assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
        assert eng.stats().get("rollout/spec_step_share", 0.0) == 0.0
    big = Arm("scripted", 6, 1)
    with spec.forced(big):
        assert spec.max_nodes == 6 and spec.choose(1) == big
        assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
        assert eng.stats()["rollout/accept_len"] > 2  # the oracle's 6-token drafts were used
    assert spec.choose(4) == spec.selector.choose(4) and spec.max_nodes == spec.selector.max_nodes
