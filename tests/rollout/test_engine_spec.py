"""Speculative decoding in the engine is exact: greedy output equals speculation off and transformers, and
sampled output keeps the target's law."""
from collections import Counter

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import TINY_VOCAB, make_tiny_hf, random_prompts
from tests.rollout.law_helpers import one_thread  # noqa: F401  (fixture of the law tests)
from tests.rollout.spec_helpers import ScriptedDrafter


def spec_engine(hf, drafter, width=1, k=4, **kw):
    spec = SpecConfig(drafter="ngram", num_draft_tokens=k, tree_width=width, max_spec_batch=10_000)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], drafter=drafter, **kw)
    eng.speculation.force(_arm(eng))  # always speculate: exactness must hold for every arm
    return eng


def _arm(eng):
    from rlspec.rollout.speculation.selectors.base import Arm

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


# The sampled-law tests: five tokens (the first from the prefill, then drafts of up to min(3, left - 1) nodes,
# so chains of 2-3 tokens and trees two deep are verified), their joint law against transformers' own
# (law_helpers.hf_exact_law: HF forward and warpers over every sequence; rare sequences pooled, none dropped,
# a sample outside the support fails)
LAW_VOCAB, LAW_PROMPT, LAW_LENGTH, LAW_N = 6, [3, 4, 5, 1], 5, 3000


def law_setup(temperature, top_p, n, prompt=LAW_PROMPT, length=LAW_LENGTH):
    """(law model, params, exact law: sequences [S, length], probabilities [S], prefix -> ranked tokens)."""
    from tests.rollout.law_helpers import hf_exact_law, make_law_model

    hf = make_law_model(LAW_VOCAB, seed=0)  # at T 0.7, top-p 0.8: 103 sequences, none above 8%
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=length, n=n, seed=0,
                            ignore_eos=True)
    return (hf, params, *hf_exact_law(hf, prompt, length, params))


def law_of_drafter(drafter: str, k: int = 3, groups: int = 100) -> dict:
    """A registered drafter drafting on every step (selector "always", chains of k), LAW_N samples at T = 1 in
    `groups` groups of the law prompt (a GRPO batch's shape: siblings drafted from; one group of 3000 made a device
    lookup over siblings read 3000 x 3000 texts a step): their joint law checked against transformers' exact law
    (chi-square); returns the engine's stats."""
    from tests.rollout.law_helpers import ALPHA, sequence_pvalue

    hf, params, seqs, probs, _ = law_setup(1.0, 1.0, LAW_N // groups)
    spec = SpecConfig(drafter=drafter, selector="always", num_draft_tokens=k, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], max_num_seqs=LAW_N)
    eng.eos_token_ids = set()
    samples = torch.tensor([r.completion_ids for r in eng.generate([LAW_PROMPT] * groups, params)])
    assert len(samples) == LAW_N
    assert sequence_pvalue(samples, seqs, probs) > ALPHA
    return eng.stats()


def likeliest_path(ranked: dict, prefix: list[int], n: int) -> list[int]:
    """The target's likeliest next tokens one after another from a completion prefix (the exact law's ranking)."""
    out = []
    for _ in range(n):
        options = ranked.get(tuple(prefix) + tuple(out))
        if not options:
            break
        out.append(options[0])
    return out


def multi_accepted(stats) -> float:
    """Share of verifies that accepted two or more drafted tokens."""
    return sum(v for k, v in stats.items() if k.startswith("rollout/accept_hist/") and int(k.rsplit("/", 1)[1]) >= 2)


@pytest.mark.parametrize("temperature,top_p,width", [(1.0, 1.0, 1), (0.7, 0.8, 1), (1.0, 1.0, 2)],
                         ids=["T1-chain", "T0.7-top_p0.8-chain", "T1-tree"])
def test_sampled_law_unchanged_by_speculation(temperature, top_p, width, monkeypatch, one_thread):
    """Joint law of five tokens with speculation forced on equals the target's (chi-square): drafts of 0-3
    tokens along the target's likeliest path, half of them replaced by random tokens; width 2: trees of that
    chain and a random first sibling, two deep. Multi-token drafts were accepted, trees verified (their first
    child accepted, a later one, or none)."""
    from tests.rollout.law_helpers import ALPHA, sequence_pvalue, spy_siblings

    hf, params, seqs, probs, ranked = law_setup(temperature, top_p, LAW_N)
    seen = spy_siblings(monkeypatch)
    drafter = ScriptedDrafter(LAW_VOCAB, lambda seq, n: likeliest_path(ranked, seq.completion_ids, n), corrupt=0.5,
                              tree=width > 1)
    eng = spec_engine(hf, drafter, width=width, k=3, max_num_seqs=LAW_N)
    eng.eos_token_ids = set()
    samples = torch.tensor([r.completion_ids for r in eng.generate([LAW_PROMPT], params)])
    assert sequence_pvalue(samples, seqs, probs) > ALPHA
    stats = eng.stats()
    assert drafter.multi >= LAW_N // 2 and multi_accepted(stats) >= 0.005, (drafter.multi, stats)
    if width > 1:
        assert drafter.deep >= LAW_N // 5 and min(seen["first"], seen["later"], seen["none"]) >= 100, seen


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


def free_speculation(monkeypatch) -> Counter:
    """A fake clock (every reading 1 ms later) makes every forward cost the same, and drafting is reported free,
    so speculation always looks worth it and a selector really does move between arms, whatever the machine
    load. Returns a Counter of the arms chosen, step by step (Speculation.choose)."""
    from rlspec.rollout.speculation.speculation import Speculation

    ticks = iter(range(10**9))
    monkeypatch.setattr("time.perf_counter", lambda: next(ticks) * 1e-3)
    observe = Speculation.observe_step
    monkeypatch.setattr(Speculation, "observe_step", lambda self, arm, batch, seconds, draft_seconds, *a:
                        observe(self, arm, batch, seconds, 0.0, *a))
    arms, choose = Counter(), Speculation.choose

    def counted(self, batch):
        arm = choose(self, batch)
        arms[arm] += 1
        return arm

    monkeypatch.setattr(Speculation, "choose", counted)
    return arms


@pytest.mark.parametrize("selector", ["fixed", "adaptive"])
def test_auto_drafters_and_selectors_are_exact(selector, monkeypatch):
    """Real drafters (suffix, n-gram, cold EAGLE-3) under either selector: arms change, output does not. Drafting
    is made to look free (free_speculation), so the selectors speculate whatever the machine load: speculative
    arms of more than one shape (the adaptive selector: of more than one drafter) ran and had drafts accepted."""
    arms = free_speculation(monkeypatch)
    hf = make_tiny_hf("llama", seed=13)
    prompts = random_prompts(4, 3, 16, seed=13)
    params = SamplingParams(temperature=0, max_new_tokens=40, n=3)
    spec = SpecConfig(drafter="auto", num_draft_tokens=4, selector=selector, online_training=False,
                      max_spec_batch=None)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    share = []
    for _ in range(2):  # the second call has the first call's rollouts in the suffix index
        assert [r.completion_ids for r in eng.generate(prompts, params)] == reference(hf, prompts, params)
        stats = eng.stats()
        share.append(stats["rollout/spec_step_share"])
        assert stats.get("rollout/accept_len", 1.0) > 1.0, stats  # drafts were verified and some accepted
    assert min(share) > 0.2, share
    used = [a for a in arms if a.speculative]
    assert len({(a.depth, a.width) for a in used}) >= 2, arms
    if selector == "adaptive":
        assert len({a.drafter for a in used}) >= 2 and "strategy/explore_share" in stats, arms


def test_adaptive_selector_keeps_the_sampled_law(monkeypatch, one_thread):
    """The bandit switches drafters and shapes step by step (counted); the law of five tokens must not notice."""
    from tests.rollout.law_helpers import ALPHA, sequence_pvalue

    arms = free_speculation(monkeypatch)
    prompt = [3, 4, 5, 1, 3, 4]
    # 40 groups of 60 through 60 rows: small live batches, where the selector does speculate
    hf, params, seqs, probs, _ = law_setup(1.0, 1.0, 60, prompt)
    spec = SpecConfig(drafter="auto", num_draft_tokens=3, selector="adaptive", online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[], max_num_seqs=60)
    samples = torch.tensor([r.completion_ids for r in eng.generate([prompt] * 40, params)])
    assert sequence_pvalue(samples, seqs, probs) > ALPHA
    stats = eng.stats()
    assert stats["rollout/spec_step_share"] > 0.2 and multi_accepted(stats) > 0.01, stats
    used = [a for a in arms if a.speculative]
    assert len({a.drafter for a in used}) >= 2 and len({(a.depth, a.width) for a in used}) >= 2, arms


def test_forced_arm_overrides_the_selector_for_a_block_and_hands_back():
    """Speculation.forced(arm): every step uses `arm` (OFF: plain decoding) inside the block, the
    cache slack follows a forced arm larger than any the selector offers, and the choice returns
    to the selector afterwards; output stays exact either way."""
    from rlspec.rollout.speculation.selectors.base import OFF, Arm

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
