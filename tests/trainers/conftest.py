"""Fixtures for trainer tests: a tiny character-level chat tokenizer and a tiny random-weight Llama.

Both are built in memory in about a second, so the tests need no network and no model download;
the tokenizer speaks ChatML like SmolLM2 (eos = <|im_end|>), so TRL's chat path runs unchanged.
"""
from __future__ import annotations

import string

import pytest
import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer():
    """One token per printable ASCII character plus ChatML specials (103 tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join without spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_llama(vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0):
    """A 2-layer Llama with hidden size 64 and random weights, float32, eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = eos_token_id
    return model


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_llama(char_tokenizer):
    return build_tiny_llama(len(char_tokenizer), char_tokenizer.eos_token_id, char_tokenizer.pad_token_id)


def assert_two_steps_synced_once(trainer, model, initial: dict) -> list[dict]:
    """After a 2-step run: the policy moved, the engine followed once (before step 2's rollout), not at
    every call, and two steps were logged. Returns the two steps' log records."""
    assert any(not torch.equal(initial[n], p) for n, p in model.named_parameters())
    assert trainer.engine.policy_version == 1 and trainer.weight_syncer.num_syncs == 1
    steps = [log for log in trainer.state.log_history if "reward" in log]
    assert len(steps) == 2
    return steps
