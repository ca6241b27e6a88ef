"""ModelConfig: the few numbers our Llama-family runtime needs, read from a Hugging Face config.

Llama, SmolLM2 (a Llama), Qwen2 (biases on q/k/v) and Qwen3 (RMSNorm on q and k per head) differ
only in a handful of switches, so one runtime serves all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2; Llama's `attention_bias`
    o_bias: bool  # Llama's `attention_bias` also covers o_proj; Qwen2 has none there
    mlp_bias: bool
    qk_norm: bool  # Qwen3
    hf_config: Any = None  # kept for RoPE variants we compute through transformers

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Build from a transformers PretrainedConfig (or anything with the same attributes)."""
        mt = getattr(hf, "model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} is not supported by rlspec's runtime; supported: {SUPPORTED_MODEL_TYPES}. "
                "Use a Llama/Qwen2/Qwen3-layout model."
            )
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported; set use_sliding_window=False")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attn_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or attn_bias,
            o_bias=attn_bias and mt != "qwen2",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=(mt == "qwen3"),
            hf_config=hf,
        )
