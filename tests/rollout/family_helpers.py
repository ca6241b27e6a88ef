"""Tiny random models of the families beyond Llama/Qwen2/Qwen3 (conftest.make_tiny_hf), float32, with every
family switch made to matter: windows short enough that 20-token sequences cross them, soft-caps low enough to
bite, Gemma's zero-centred norms and Qwen2's biases drawn away from their neutral init."""
from __future__ import annotations

import torch

from tests.conftest import TINY_VOCAB

WINDOW = 5
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = ("mistral", "qwen2_window", "gemma", "gemma2", "gemma3", "qwen3_moe", "custom_llama")


def _configs(kind: str):
    import transformers as tf

    if kind == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=WINDOW), tf.MistralForCausalLM
    if kind == "qwen2_window":  # layers >= max_window_layers slide
        return tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), \
            tf.Qwen2ForCausalLM
    if kind == "gemma":
        return tf.GemmaConfig(**COMMON, tie_word_embeddings=True), tf.GemmaForCausalLM
    if kind == "gemma2":
        return tf.Gemma2Config(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                               final_logit_softcapping=4.0, tie_word_embeddings=True,
                               attn_implementation="eager"), tf.Gemma2ForCausalLM  # SDPA would drop the cap (5.17)
    if kind == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
        return tf.Gemma3TextConfig(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=24, rope_parameters=rope,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   final_logit_softcapping=4.0, tie_word_embeddings=True), tf.Gemma3ForCausalLM
    if kind == "qwen3_moe":  # layer 1 dense (mlp_only_layers), 0 and 2 routed; top-2 of 4, renormalised
        return tf.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True, mlp_only_layers=[1]), tf.Qwen3MoeForCausalLM
    if kind == "custom_llama":
        return CustomLlamaConfig(**COMMON), CustomLlamaForCausalLM
    raise ValueError(kind)


def make_family(kind: str, seed: int = 0):
    config, cls = _configs(kind)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Gemma's zero-centred norms (times 1 + w), biases and the MoE router start at 0: make them count
            if (kind.startswith("gemma") and "norm" in name) or name.endswith(".bias") or "mlp.gate." in name:
                p.normal_(0, 0.1)
    return model


def _custom_classes():
    """A trust_remote_code-style Llama: its own config and model classes and model_type, Llama's computation."""
    import transformers as tf

    class CustomLlamaConfig(tf.LlamaConfig):
        model_type = "custom_llama"

    class CustomLlamaForCausalLM(tf.LlamaForCausalLM):
        config_class = CustomLlamaConfig

    return CustomLlamaConfig, CustomLlamaForCausalLM


CustomLlamaConfig, CustomLlamaForCausalLM = _custom_classes()
