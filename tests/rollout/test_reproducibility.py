"""What SamplingParams.seed promises (see its comment in rollout/types.py), tested exactly.

Off: the same seed gives identical rollouts, call after call and engine after engine. On: the same
holds given the same arm at every step (selector "always") and the same drafter state; here the
learned drafter samples its drafts (T > 0), so its random draws are part of what must repeat.
"""
import pytest

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.law_helpers import one_thread  # noqa: F401  (fixture)

PROMPTS = random_prompts(3, 4, 9, seed=4)


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16, n=4, seed=seed, ignore_eos=True)


def rollouts(eng, seed: int):
    return [(r.completion_ids, r.logprobs) for r in eng.generate(PROMPTS, params(seed))]


def engine(hf, spec: SpecConfig | None = None):
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    return eng


def test_same_seed_same_rollouts_without_speculation():
    hf = make_tiny_hf("llama", seed=4)
    eng = engine(hf)
    first = rollouts(eng, 7)
    assert rollouts(eng, 7) == first  # the same engine again
    assert rollouts(engine(hf), 7) == first  # a fresh engine
    assert rollouts(eng, 8) != first  # and the seed does matter


@pytest.mark.parametrize("width", [1, 2], ids=["chain", "tree"])
def test_same_seed_same_arms_same_drafter_same_rollouts(width):
    hf = make_tiny_hf("llama", seed=4)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, tree_width=width, selector="always",
                      online_training=False)  # weights fixed: the drafter state stays the same
    eng = engine(hf, spec)
    first = rollouts(eng, 7)
    stats = eng.stats()
    assert stats["rollout/spec_step_share"] > 0.8 and stats["rollout/accept_rate"] > 0  # it did speculate
    assert rollouts(eng, 7) == first
    assert rollouts(engine(hf, spec), 7) == first  # a fresh engine builds the same cold drafter
    assert rollouts(eng, 8) != first
