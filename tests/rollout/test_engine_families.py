"""The engine on the families beyond Llama/Qwen2/Qwen3 (tests/rollout/family_helpers.py): greedy equals
transformers' generate, with and without chain speculation (verify steps of T > 1 across the sliding windows),
and the per-token logprobs are transformers' forward's."""
import pytest
import torch

from rlspec.rollout.types import SamplingParams
from tests.conftest import TINY_VOCAB, random_prompts
from tests.rollout.family_helpers import FAMILIES, make_family
from tests.rollout.spec_helpers import ScriptedDrafter
from tests.rollout.test_engine_ar import engine_for, hf_greedy
from tests.rollout.test_engine_spec import oracle_from, spec_engine


def _hf_completions(hf, prompts, max_new):
    out = []
    for p in prompts:
        ref = hf_greedy(hf, p, max_new, eos=2)
        out.append(ref[: ref.index(2) + 1] if 2 in ref else ref)
    return out


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_matches_transformers(kind):
    hf = make_family(kind, seed=1)
    prompts = random_prompts(4, 2, 12, seed=6)
    got = engine_for(hf).generate(prompts, SamplingParams(temperature=0, max_new_tokens=16))
    assert [r.completion_ids for r in got] == _hf_completions(hf, prompts, 16)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3", "qwen3_moe"])
def test_greedy_with_chain_speculation_matches_transformers(kind):
    hf = make_family(kind, seed=2)
    prompts = random_prompts(5, 2, 12, seed=7)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    ref = _hf_completions(hf, prompts, 20)
    eng = spec_engine(hf, ScriptedDrafter(TINY_VOCAB, oracle_from(ref), corrupt=0.3, seed=3), k=6)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    assert eng.stats()["rollout/accept_len"] > 1.0  # verify steps of several tokens really ran


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3", "qwen3_moe"])
def test_logprobs_are_transformers_logprobs(kind):
    hf = make_family(kind, seed=3)
    prompt = random_prompts(1, 6, 6, seed=8)[0]
    params = SamplingParams(temperature=0.7, max_new_tokens=12, seed=1, ignore_eos=True)
    r = engine_for(hf).generate([prompt], params)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + r.completion_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4)


def test_moe_models_run_without_cuda_graphs():
    """The experts loop depends on the routing (rollout/runtime/model/moe.py): no capture, whatever is asked."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader

    assert RolloutEngine(loader.from_hf_model(make_family("qwen3_moe")), None, graph_mode="lazy").runner.graph_mode \
        == "off"
    assert RolloutEngine(loader.from_hf_model(make_family("gemma3")), None, graph_mode="lazy").runner.graph_mode \
        == "lazy"
