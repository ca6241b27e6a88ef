"""vLLM's n-gram method through the SpecConfig mapping, with the policy's logprobs under speculation.

This file runs after every other vLLM test on purpose (pytest takes files in name order, and `make
test-vllm` runs the export check first): vLLM's n-gram drafter imports numba, hence llvmlite, and once
llvmlite is imported, starting another vLLM in the same process fails in vLLM 0.32's CPU kernel scan
(`'_lib_fn_wrapper' object has no attribute 'get'`, docs/vllm_backend.md#known-vllm-issues).
"""
from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import NO_VLLM

pytest.importorskip("vllm", reason=NO_VLLM)

from rlspec.rollout.backend import build_backend
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.vllm.test_backend import KW, hf_logprobs


def test_ngram_speculation_is_lossless_and_counted(tiny_llama64, char_tokenizer):
    """vLLM's n-gram method through the mapping (selector always: k=3 at every step): greedy tokens
    unchanged, drafts counted in rollout/accept_len."""
    spec = SpecConfig(drafter="ngram", num_draft_tokens=3, selector="always")
    backend = build_backend("vllm", tiny_llama64, char_tokenizer, spec, **KW)
    assert backend.speculative_config["method"] == "ngram"
    prompts = [char_tokenizer.encode("abcabcabcabc"), char_tokenizer.encode("1 2 1 2 1 2")]
    params = SamplingParams(temperature=0, max_new_tokens=24, n=1)
    plain = build_backend("engine", tiny_llama64, char_tokenizer, None, **KW).generate(prompts, params)
    assert [r.completion_ids for r in backend.generate(prompts, params)] == [r.completion_ids for r in plain]
    # under speculation the logprobs stay the policy's at the call's temperature (cpu_fixes.py on CPU)
    for temperature in (1.0, 0.7):
        for r in backend.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=24, n=2, seed=0)):
            want = hf_logprobs(tiny_llama64, r.prompt_ids, r.completion_ids, temperature)
            assert torch.allclose(want, torch.tensor(r.logprobs), atol=1e-4)
    stats = backend.stats()
    assert stats["vllm/max_depth"] == 3.0
    assert stats["rollout/accept_len"] >= 1.0 and stats["rollout/accept_rate"] > 0  # vLLM drafted and accepted
    backend.close()
