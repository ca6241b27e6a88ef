"""Fixtures for the vLLM backend's tests (`make test-vllm`, inside .venv-vllm); without vLLM they skip.

vLLM's CPU attention supports only some head sizes (16 is not one), so the tiny policy here has
head_dim 64: 2 layers (8 where an EAGLE-3 drafter needs three distinct layers to read), hidden 128, 2 query heads and 1 KV head, the char tokenizer's 103-token vocabulary.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in this process, as the backend runs it
# each test module skips itself without vLLM (a skip raised here would be a collection error)
NO_VLLM = "the vLLM backend's tests run in the environment `make vllm-venv` builds"

from tests.trainers.conftest import char_tokenizer  # noqa: E402,F401  (the fixture, re-exported)


def build_tiny_llama64(tokenizer, seed: int = 0, layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.1, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@pytest.fixture
def tiny_llama64(char_tokenizer):  # noqa: F811
    return build_tiny_llama64(char_tokenizer)
