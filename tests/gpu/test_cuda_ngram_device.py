"""The n-gram drafter looked up on the device (drafters/ngram_device.py) on CUDA: its lookup replayed from CUDA
graphs gives the eager lookup's drafts, and greedy rollouts drafting with it are the plain ones with the target's
graph pool, rows admitted and retired; its chains looked ahead (rollout/chains_ahead.py, on by default on CUDA) give
the step-by-step rollouts."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.speculation.drafters.ngram_device import DeviceNgramDrafter
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_graph_lookup_gives_the_eager_drafts_and_greedy_parity(monkeypatch):
    from rlspec.bench.host import tiny_model

    prompts = random_prompts(6, 8, 16, seed=0, vocab=64)
    params = SamplingParams(temperature=0, max_new_tokens=64, n=2, ignore_eos=True)

    def target():
        return tiny_model(3, "cuda")

    plain = RolloutEngine(target(), None, eos_token_ids=[2])
    want = [r.completion_ids for r in plain.generate(prompts, params)]
    spec = SpecConfig(drafter="ngram_device", selector="always", num_draft_tokens=4, online_training=False)
    engine = RolloutEngine(target(), None, spec=spec, eos_token_ids=[2], max_num_seqs=8)
    drafter = engine.speculation.by_name["ngram_device"]
    compared, lookup = [0], DeviceNgramDrafter._lookup

    def checked(self, rows, L, D):  # each graph's drafts against the eager lookup of the same rows
        got = lookup(self, rows, L, D)
        self.graph_mode = "off"
        try:
            eager = lookup(self, rows, L, D)
        finally:
            self.graph_mode = "auto"
        assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
        compared[0] += 1
        return got

    monkeypatch.setattr(DeviceNgramDrafter, "_lookup", checked)
    assert [r.completion_ids for r in engine.generate(prompts, params)] == want
    assert drafter.graphs is not None and drafter.graphs.backend == "cuda"
    assert drafter.graphs.counts["replays"] > drafter.graphs.counts["captures"] > 0 and compared[0] > 20
    assert engine.stats()["rollout/accept_len"] > 1.1


@pytest.mark.parametrize("keyed", [False, True])
def test_cuda_chains_looked_ahead_give_the_step_by_step_rollouts(keyed, monkeypatch):
    from tests.rollout.test_chains_ahead import assert_same_rollouts

    assert_same_rollouts(keyed, "cuda", monkeypatch)
