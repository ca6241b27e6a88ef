"""VLLMBackend against rlspec's engine and HF on a tiny float32 Llama: same greedy tokens, logprobs of the
sampling distribution, prompt-major order, and policy weights that reach vLLM (its outputs follow them)."""
from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import NO_VLLM

pytest.importorskip("vllm", reason=NO_VLLM)

from rlspec.rollout.backend import RolloutBackend, build_backend
from rlspec.rollout.types import SamplingParams, SpecConfig

KW = dict(max_model_len=128, max_num_seqs=8, dtype="float32")


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


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
    from rlspec.rollout.vllm_backend.spec_map import UnsupportedSpec

    with pytest.raises(UnsupportedSpec, match="tree_width"):
        build_backend("vllm", tiny_llama64, char_tokenizer, SpecConfig(drafter="ngram", tree_width=2), **KW)


def test_long_tail_depth_table_from_vllms_measured_costs_follows_acceptance(char_tokenizer):
    """selector fixed: vLLM's per-batch-size depth table comes from vLLM's own step times at every batch bucket
    and depth (step_costs.measure) and vLLM's counted acceptance; it is installed in vLLM's scheduler and
    rebuilt when the acceptance moves (rollout/vllm_backend/step_costs.py). The drafter host holds no policy."""
    from rlspec.rollout.vllm_backend import step_costs, weights
    from tests.vllm.conftest import build_tiny_llama64

    policy = build_tiny_llama64(char_tokenizer, layers=8)
    backend = build_backend("vllm", policy, char_tokenizer, SpecConfig(drafter="eagle3", num_draft_tokens=4,
                                                                      selector="fixed"), **KW)
    try:
        assert not any("layers" in n for n, _ in backend.host.drafter.target.named_parameters())
        assert set(backend.costs) == {(b, d) for b in (1, 2, 4, 8) for d in (0, 1, 2, 4)}
        assert all(c > 0 for c in backend.costs.values())
        assert backend.speculative_config["num_speculative_tokens"] == 4  # vLLM can draft up to k; the table says how many
        lookup = step_costs.scheduler(backend.llm).dynamic_sd_lookup
        assert [lookup[b] for b in range(1, 9)] == [backend.depth_table.depth(b) for b in range(1, 9)]
        # a drafter that is never accepted: once counted, the table turns speculation off everywhere
        backend._table_counters = {"drafts": 0.0, "per_pos": [0.0]}
        backend._retable({"drafts": 100.0, "per_pos": [0.0, 0.0, 0.0, 0.0]})
        assert backend.acceptance == 0.0 and backend.depth_table.max_depth == 0
        before = weights.spec_counters(backend.llm)["drafts"]
        out = backend.generate([char_tokenizer.encode("hi")], SamplingParams(temperature=1.0, max_new_tokens=6, n=2,
                                                                            seed=0))
        assert len(out) == 2 and weights.spec_counters(backend.llm)["drafts"] == before  # vLLM drafted nothing
        # one that always is: deep drafts at small batches again
        backend._retable({"drafts": 200.0, "per_pos": [100.0, 100.0, 100.0, 100.0]})
        assert backend.depth_table.depth(1) == 4 and step_costs.scheduler(backend.llm).dynamic_sd_lookup[1] == 4
    finally:
        backend.close()


def test_speculative_logprobs_are_exact_at_any_temperature(char_tokenizer):
    """With drafts verified at temperature 0.7, every completion token's logprob is the policy's
    log softmax(logits / 0.7) and the law is sampled at 0.7: vLLM's CPU build divided the drafted
    positions' logits by uninitialised memory before rollout/vllm_backend/cpu_fixes.py."""
    from tests.vllm.conftest import build_tiny_llama64

    policy = build_tiny_llama64(char_tokenizer, layers=8)
    backend = build_backend("vllm", policy, char_tokenizer, SpecConfig(drafter="eagle3", num_draft_tokens=3,
                                                                      selector="always"), **KW)
    try:
        prompts = [char_tokenizer.encode("abcabc"), char_tokenizer.encode("what is 2+3?")]
        for temperature in (0.7, 1.0):
            for r in backend.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=16, n=2, seed=1)):
                want = hf_logprobs(policy, r.prompt_ids, r.completion_ids, temperature)
                assert torch.allclose(want, torch.tensor(r.logprobs), atol=1e-4), (temperature, want, r.logprobs)
        assert backend.stats()["rollout/accept_len"] >= 1.0  # vLLM verified drafts at those positions
    finally:
        backend.close()
