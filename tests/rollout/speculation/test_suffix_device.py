"""suffix_device (drafters/suffix_device.py): each row takes the suffix drafter's chain where it has one and the device
lookup's otherwise, and an engine drafting with it is exact (greedy parity, the sampled law)."""
from __future__ import annotations

import pytest

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.speculation.drafters.ngram_device import DeviceNgramDrafter
from rlspec.rollout.speculation.drafters.suffix import SuffixDrafter
from rlspec.rollout.speculation.drafters.suffix_device import SuffixDeviceDrafter
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import random_prompts
from tests.rollout.law_helpers import one_thread  # noqa: F401  (fixture of the law tests)


def target():
    from rlspec.bench.host import tiny_model  # peaked logits: rollouts repeat themselves, so n-grams match

    return tiny_model(3)


def engine(**kw) -> RolloutEngine:
    spec = SpecConfig(drafter="suffix_device", selector="always", num_draft_tokens=4, online_training=False)
    return RolloutEngine(target(), None, spec=spec, eos_token_ids=[2], **kw)


def test_each_row_takes_suffixs_chain_else_the_lookups(monkeypatch):
    """Every proposal of a sampled rollout, row by row, against what the two drafters inside proposed for it at that
    step: suffix's chain (and its length) where it drafted, the device lookup's full chain elsewhere; both occurred."""
    seen = {"suffix": 0, "lookup": 0}
    inner: dict = {}
    suffix_propose, device_propose = SuffixDrafter.propose, DeviceNgramDrafter.propose_tensors

    def suffix_spy(self, *args):
        inner["suffix"] = suffix_propose(self, *args)
        return inner["suffix"]

    def device_spy(self, *args):
        out = device_propose(self, *args)
        inner["lookup"] = out.to_drafts()
        return out

    monkeypatch.setattr(SuffixDrafter, "propose", suffix_spy)
    monkeypatch.setattr(DeviceNgramDrafter, "propose_tensors", device_spy)
    composed = SuffixDeviceDrafter.propose_tensors

    def compared(self, seqs, caps, width):
        out = composed(self, seqs, caps, width)
        for i, got in enumerate(out.to_drafts()):
            s, looked = inner["suffix"][i], inner["lookup"][i]
            if len(s):
                assert got.tokens == s.tokens
                seen["suffix"] += 1
            elif caps[i]:
                assert got.tokens == looked.tokens and len(got) == caps[i]
                seen["lookup"] += 1
        return out

    monkeypatch.setattr(SuffixDeviceDrafter, "propose_tensors", compared)
    eng = engine(max_num_seqs=6)
    eng.generate(random_prompts(4, 8, 16, seed=0, vocab=64),
                 SamplingParams(temperature=0.5, max_new_tokens=60, n=2, seed=0, ignore_eos=True))
    assert seen["suffix"] >= 30 and seen["lookup"] >= 30, seen


def test_greedy_exact():
    prompts = random_prompts(5, 8, 16, seed=1, vocab=64)
    params = SamplingParams(temperature=0, max_new_tokens=48, n=2, ignore_eos=True)
    ref = [r.completion_ids for r in RolloutEngine(target(), None, eos_token_ids=[2]).generate(prompts, params)]
    eng = engine(max_num_seqs=4)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    assert eng.stats()["rollout/accept_hist/2"] > 0


def test_sampled_law_unchanged(one_thread):
    from tests.rollout.test_engine_spec import law_of_drafter, multi_accepted

    assert multi_accepted(law_of_drafter("suffix_device")) >= 0.005


def test_its_checkpoint_is_both_histories():
    eng = engine()
    eng.generate(random_prompts(2, 8, 16, seed=2, vocab=64), SamplingParams(temperature=1.0, max_new_tokens=20, n=2))
    from tests.rollout.speculation.test_state import same

    drafter = eng.speculation.by_name["suffix_device"]
    state = eng.speculation.state_dict()["drafters"]["suffix_device"]
    assert state["suffix"]["prompts"] and state["device"]["history"]["counts"] == [2, 2]  # the rollout is history
    same(state["suffix"], drafter.suffix.state_dict())
    same(state["device"], drafter.device.state_dict())
    fresh = engine()
    fresh.speculation.load_state_dict(eng.speculation.state_dict())
    same(fresh.speculation.by_name["suffix_device"].state_dict(), drafter.state_dict())


def test_trees_are_refused_before_any_step():
    with pytest.raises(ValueError, match="suffix_device drafts chains"):
        RolloutEngine(target(), None, eos_token_ids=[2],
                      spec=SpecConfig(drafter="suffix_device", num_draft_tokens=4, tree_width=2))
