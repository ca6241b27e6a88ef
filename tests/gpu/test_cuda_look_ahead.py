"""Plain steps launched before the host reads the step in front of them, on CUDA with the graph pool (the default
there: rollout/decode.py): the rollouts of the step-by-step loop, greedy and with keyed draws, rows ending at
different steps; most steps launched ahead; with an EAGLE-3 drafter, the features each plain step stages as it is
launched give the step-by-step loop's drafts."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.test_look_ahead import assert_learned_look_ahead, launches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("keyed", [False, True])
def test_cuda_look_ahead_gives_the_step_by_step_rollouts(keyed, monkeypatch):
    hf = make_tiny_hf("llama", seed=11).cuda()
    prompts = random_prompts(5, 4, 40, seed=2)
    params = SamplingParams(temperature=1.0 if keyed else 0.0, max_new_tokens=20, n=2)
    keys = list(range(100, 110)) if keyed else None

    def run(look_ahead: bool, eos):
        engine = RolloutEngine(loader.from_hf_model(hf, torch.float32, "cuda"), None, eos_token_ids=eos)
        assert engine.look_ahead  # the CUDA default
        engine.look_ahead = look_ahead
        return [(r.completion_ids, r.finish_reason) for r in engine.generate(prompts, params, sample_keys=keys)]

    stops = sorted({ids[2] for ids, _ in run(False, [])[:3]})
    want = run(False, stops)
    seen = launches(monkeypatch)
    assert run(True, stops) == want
    assert {why for _, why in want} == {"stop", "length"} and sum(seen) > len(seen) // 2


def test_cuda_look_ahead_with_a_learned_drafter_gives_the_step_by_step_drafts(monkeypatch):
    assert_learned_look_ahead(make_tiny_hf("llama", seed=11).cuda(), "cuda", monkeypatch)
