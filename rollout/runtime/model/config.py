"""ModelConfig: the few numbers our Llama-family runtime needs, read from a Hugging Face config.

Llama, SmolLM2 (a Llama), Qwen2 (biases on q/k/v) and Qwen3 (RMSNorm on q and k per head) differ
only in a handful of switches, so one runtime serves all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE variants whose frequencies are fixed at load (llama.rope_inv_freq computes them as transformers
# does). "dynamic" and "longrope" change frequencies with the sequence length inside the forward: refused.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
_USE_TRL = "use trl.GRPOTrainer's own generation (or vLLM) for this model"


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
    sliding_window: int | None = None  # a window that changes attention (the engine caps its context to it)
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
        check_rope(hf)
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
            sliding_window=effective_window(hf),
            hf_config=hf,
        )


def check_rope(hf: Any) -> None:
    """Refuse RoPE variants the runtime would compute differently from transformers, by name."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(f"per-layer-type RoPE parameters ({sorted(params)}) are not supported by "
                                    f"rlspec's runtime; {_USE_TRL}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} is not supported by rlspec's runtime (it computes {STATIC_ROPE_TYPES}; "
            f"'dynamic' and 'longrope' rescale with the sequence length during the forward); {_USE_TRL}")


def effective_window(hf: Any) -> int | None:
    """The sliding-attention window that can change results, or None. None also when the config carries a
    window it does not use (use_sliding_window False, no sliding layer in layer_types, or a window as long as
    max_position_embeddings): Mistral/Qwen2 configs often do. Unknown layer types are refused by name."""
    types = list(getattr(hf, "layer_types", None) or [])
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"attention layer types {unknown} are not supported by rlspec's runtime "
                                    f"(full attention only); {_USE_TRL}")
    window = getattr(hf, "sliding_window", None)
    if not window or not getattr(hf, "use_sliding_window", True):
        return None
    if types and "sliding_attention" not in types:
        return None
    return window if window < getattr(hf, "max_position_embeddings", window) else None


def check_window(cfg: ModelConfig, max_model_len: int) -> None:
    """A sliding window no sequence can cross is full attention; refuse a context that would cross it."""
    if cfg.sliding_window is not None and max_model_len > cfg.sliding_window:
        raise UnsupportedModelError(
            f"the model uses sliding-window attention (window {cfg.sliding_window} tokens), which rlspec's runtime "
            f"does not implement, and max_model_len={max_model_len} would let sequences cross the window. Set "
            f"max_model_len <= {cfg.sliding_window} (rollout.max_model_len) or {_USE_TRL}")
