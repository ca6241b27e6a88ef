"""Repetition penalty in the engine: greedy output equals transformers' generate token for token (float32),
with speculation off, chains and trees, rows compacted as samples finish and sequences preempted.

transformers applies RepetitionPenaltyLogitsProcessor over the prompt and every generated token; under
speculation each verified node must see its own history (the row's tokens plus the drafts on its path),
so a draft that repeats an earlier draft token is judged against the penalised argmax. The drafter
proposes the reference continuation with corruption, so drafts of several tokens are accepted and
rejected in every batch (asserted).
"""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import TINY_VOCAB, make_tiny_hf, random_prompts
from tests.rollout.spec_helpers import ScriptedDrafter

PENALTY, MAX_NEW = 1.3, 30


def hf_greedy(hf, prompt: list[int], penalty: float) -> list[int]:
    """generate's own greedy decoding with the penalty; up to and including EOS (id 2)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2,
                          pad_token_id=0, repetition_penalty=penalty)
    return out[0, len(prompt):].tolist()


def engine(hf, drafter=None, width=1, **kw) -> RolloutEngine:
    spec = None if drafter is None else SpecConfig(drafter="ngram", num_draft_tokens=4, tree_width=width,
                                                   max_spec_batch=10_000)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], drafter=drafter, **kw)
    if drafter is not None:
        from rlspec.rollout.speculation.selectors.base import Arm

        eng.speculation.force(Arm("scripted", 4, width))  # every step speculates
    return eng


@pytest.mark.parametrize("mode", ["plain", "chain", "tree", "chain-preempted"])
def test_greedy_with_penalty_matches_transformers(mode):
    hf = make_tiny_hf("llama", seed=5)
    prompts = random_prompts(6, 2, 20, seed=5)
    ref = [hf_greedy(hf, p, PENALTY) for p in prompts]
    assert ref != [hf_greedy(hf, p, 1.0) for p in prompts]  # the penalty changes the text: the test can tell
    drafter = None
    if mode != "plain":
        def oracle(seq, n):  # the reference continuation, then junk
            r = ref[seq.prompt_index][len(seq.completion_ids):]
            return (r + [7, 8, 9, 10])[:n]
        drafter = ScriptedDrafter(TINY_VOCAB, oracle, corrupt=0.3, seed=1, tree=mode == "tree")
    # 3 rows for 6 prompts: finished samples leave and rows are compacted mid-call
    kw = {"kv_block_size": 4, "kv_memory_gb": 24 * 2 * 2 * 4 * 2 * 16 * 4 / 2**30} if mode.endswith("preempted") \
        else {"max_num_seqs": 3}
    eng = engine(hf, drafter, width=2 if mode == "tree" else 1, **kw)
    got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, repetition_penalty=PENALTY))
    assert [r.completion_ids for r in got] == ref
    stats = eng.stats()
    if drafter is not None:
        assert stats["rollout/accept_len"] > 1.0 and stats["rollout/accept_rate"] < 1.0, stats
    if mode.endswith("preempted"):
        assert stats["rollout/preemptions"] > 0, stats


@pytest.mark.parametrize("width", [1, 2])
def test_greedy_with_penalty_and_eagle3_matches_transformers(width):
    """EAGLE-3 at temperature 0 drafts the top-w of its penalised logits (its branches' own histories):
    proposals only, so the output must still be generate's."""
    hf = make_tiny_hf("llama", seed=5)
    prompts = random_prompts(4, 2, 20, seed=6)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=4, tree_width=width, selector="always",
                      online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, repetition_penalty=PENALTY))
    assert [r.completion_ids for r in got] == [hf_greedy(hf, p, PENALTY) for p in prompts]
    assert eng.stats()["rollout/spec_step_share"] > 0.5


def test_penalty_refused_with_a_lossy_mode():
    hf = make_tiny_hf("llama", seed=5)
    spec = SpecConfig(drafter="eagle3", verification="judge", accept_off_policy=True, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    with pytest.raises(ValueError, match="repetition_penalty"):
        eng.generate([[3, 4]], SamplingParams(max_new_tokens=2, repetition_penalty=1.2))


@pytest.mark.parametrize("bad", [dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0.0),
                                 dict(repetition_penalty=float("inf"))])
def test_params_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
