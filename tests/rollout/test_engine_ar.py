"""The autoregressive engine: greedy equals transformers' generate; sampling has the right law."""
import math

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.errors import PromptTooLongError
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts


def hf_greedy(hf, prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_for(hf, **kw) -> RolloutEngine:
    return RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_mixed_lengths(kind):
    hf = make_tiny_hf(kind)
    prompts = random_prompts(6, 2, 25, seed=3)
    got = engine_for(hf).generate(prompts, SamplingParams(temperature=0, max_new_tokens=24))
    for r, p in zip(got, prompts):
        ref = hf_greedy(hf, p, 24, eos=2)
        ref = ref[: ref.index(2) + 1] if 2 in ref else ref
        assert r.completion_ids == ref
        assert r.finish_reason == ("stop" if ref[-1] == 2 else "length")


def test_greedy_batch_equals_batch_of_one_with_row_limit():
    """Fewer rows than sequences: admission waits for rows to free; results stay in order."""
    hf = make_tiny_hf("llama", seed=4)
    prompts = random_prompts(7, 2, 12, seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=20, n=2)
    batched = engine_for(hf, max_num_seqs=4).generate(prompts, params)
    single = [engine_for(hf).generate([p], params) for p in prompts]
    assert [r.completion_ids for r in batched] == [r.completion_ids for rs in single for r in rs]
    assert [(r.prompt_index, r.sample_index) for r in batched] == [(i, j) for i in range(7) for j in range(2)]


def test_logprobs_are_target_logprobs():
    hf = make_tiny_hf("llama")
    prompt = random_prompts(1, 5, 5)[0]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10, seed=1, ignore_eos=True)
    r = engine_for(hf).generate([prompt], params)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + r.completion_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4)


def test_seed_reproducible_and_n_samples_differ():
    hf = make_tiny_hf("llama")
    eng = engine_for(hf)
    p = random_prompts(2, 4, 8)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=7, ignore_eos=True)
    a = [r.completion_ids for r in eng.generate(p, params)]
    b = [r.completion_ids for r in eng.generate(p, params)]
    assert a == b and len(a) == 6
    assert len({tuple(x) for x in a[:3]}) > 1


def test_sampling_distribution_matches_target():
    """Two-token sequences sampled by the engine follow the target's joint law (chi-square)."""
    from scipy.stats import chisquare

    hf = make_tiny_hf("llama", vocab=8)
    prompt = [3, 4, 5]
    params = SamplingParams(temperature=1.0, max_new_tokens=2, n=4000, seed=0, ignore_eos=True)
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[], max_num_seqs=4000)
    counts = torch.zeros(8, 8)
    for r in eng.generate([prompt], params):
        counts[r.completion_ids[0], r.completion_ids[1]] += 1
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        joint = torch.stack([p1[a] * torch.softmax(hf(torch.tensor([prompt + [a]])).logits[0, -1], -1)
                             for a in range(8)])
    exp = joint.flatten() * counts.sum()
    keep = exp > 5
    obs, exp = counts.flatten()[keep], exp[keep]
    _, pval = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
    assert pval > 1e-3


def test_prompt_too_long_names_length_and_limit():
    eng = engine_for(make_tiny_hf("llama"), max_model_len=16)
    with pytest.raises(PromptTooLongError, match=r"prompt 1 has 20 tokens .* 16"):
        eng.generate([[3] * 5, [3] * 20], SamplingParams(max_new_tokens=4))


def test_length_clipped_to_context_and_stats():
    eng = engine_for(make_tiny_hf("llama"), max_model_len=16)
    r = eng.generate([[3] * 10], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))[0]
    assert len(r.completion_ids) == 6 and r.finish_reason == "length"
    s = eng.stats()
    assert s["rollout/generated_tokens"] == 6 and s["rollout/tokens_per_s"] > 0
    assert eng.stats()["rollout/generated_tokens"] == 0  # reset on read


def test_load_weights_bumps_version_and_changes_output():
    a, b = make_tiny_hf("llama", seed=0), make_tiny_hf("llama", seed=1)
    eng = engine_for(a)
    p = random_prompts(2, 4, 8)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before = eng.generate(p, params)
    eng.load_weights(b.state_dict().items())
    after = eng.generate(p, params)
    assert after[0].policy_version == before[0].policy_version + 1
    assert [r.completion_ids for r in after] == [r.completion_ids for r in engine_for(b).generate(p, params)]


def test_load_weights_rejects_unknown_names():
    eng = engine_for(make_tiny_hf("llama"))
    with pytest.raises(KeyError, match="no place"):
        eng.load_weights([("model.vision_tower.weight", torch.zeros(1))])


def test_two_engines_can_share_one_model():
    """A short-context engine must not shrink the RoPE table a long-context engine relies on."""
    model = loader.from_hf_model(make_tiny_hf("llama"))
    long_eng = RolloutEngine(model, None, eos_token_ids=[2], max_model_len=64)
    short_eng = RolloutEngine(model, None, eos_token_ids=[2], max_model_len=16)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    first = long_eng.generate([[3, 4, 5]], params)
    short_eng.generate([[3, 4, 5]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert long_eng.generate([[3, 4, 5]], params)[0].completion_ids == first[0].completion_ids
