"""VLLMBackend against rlspec's engine and HF on a tiny float32 Llama: same greedy tokens, logprobs of the
sampling distribution, prompt-major order, and policy weights that reach vLLM (its outputs follow them)."""
from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import NO_VLLM

pytest.importorskip("vllm", reason=NO_VLLM)

from rollout.backend import RolloutBackend, build_backend
from rollout.types import SamplingParams, SpecConfig

KW = dict(max_model_len=128, max_num_seqs=8, dtype="float32")


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_vllm_backend_matches_the_engine_and_follows_weight_pushes(tiny_llama64, char_tokenizer):
    backend = build_backend("vllm", tiny_llama64, char_tokenizer, None, **KW)
    assert isinstance(backend, RolloutBackend)
    prompts = [char_tokenizer.encode("hello"), char_tokenizer.encode("what is 2+3?")]
    greedy = SamplingParams(temperature=0, max_new_tokens=12, n=2, seed=0)

    def engine_greedy():
        return [r.completion_ids for r in build_backend("engine", tiny_llama64, char_tokenizer, None, **KW)
                .generate(prompts, greedy)]

    got = backend.generate(prompts, greedy)
    assert [(r.prompt_index, r.sample_index) for r in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.completion_ids for r in got] == engine_greedy()
    assert all(r.policy_version == 0 for r in got)

    # at temperature 1 the logprobs are the sampling distribution's, as TRL recomputes them
    sampled = backend.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=0))
    assert len({tuple(r.completion_ids) for r in sampled}) > 1  # samples of one call differ
    for r in sampled:
        assert torch.allclose(hf_logprobs(tiny_llama64, r.prompt_ids, r.completion_ids), torch.tensor(r.logprobs),
                              atol=1e-4)
    again = backend.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=0))
    assert [r.completion_ids for r in again] == [r.completion_ids for r in sampled]  # the seed reproduces

    # new policy weights: vLLM's greedy outputs change, to exactly what the engine makes of the new weights
    with torch.no_grad():
        for p in tiny_llama64.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    backend.load_weights(tiny_llama64.named_parameters())
    moved = backend.generate(prompts, greedy)
    assert [r.completion_ids for r in moved] != [r.completion_ids for r in got]
    assert [r.completion_ids for r in moved] == engine_greedy()
    assert all(r.policy_version == 1 for r in moved)

    stats = backend.stats()
    assert stats["rollout/num_sequences"] == 16 and stats["rollout/policy_version"] == 1.0
    assert "rollout/accept_len" not in stats  # no speculation, no acceptance figures
    backend.close()


def test_unsupported_spec_fails_before_vllm_starts(tiny_llama64, char_tokenizer):
    from rollout.vllm_backend.spec_map import UnsupportedSpec

    with pytest.raises(UnsupportedSpec, match="tree_width"):
        build_backend("vllm", tiny_llama64, char_tokenizer, SpecConfig(drafter="ngram", tree_width=2), **KW)
