"""ModelConfig: the few numbers our Llama-family runtime needs, read from a Hugging Face config.

Supported families (families.py says how a model is recognised as one, by its classes, not its name):
  * Llama and SmolLM2 (a Llama); Mistral (every layer sliding when `sliding_window` is set);
  * Qwen2 (biases on q/k/v; `use_sliding_window` + `max_window_layers`), Qwen3 (RMSNorm on q and k per head),
    Qwen3-MoE (Qwen3 attention, routed experts: moe.py);
  * Gemma (RMSNorm scaled by 1 + weight in float32, embeddings times sqrt(hidden), GeGLU with tanh GELU),
    Gemma 2 (+ norms after attention and around the MLP, query_pre_attn_scalar, attention and final logit
    soft-capping, alternating sliding layers), Gemma 3 text (Gemma 2 without attention soft-capping, + q/k norms
    and a RoPE base of its own for sliding layers).
They differ only in the switches below, so one runtime serves all of them; a switch a family does not use
costs the others nothing (no extra op is added for it).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import Any

from rlspec.rollout.errors import UnsupportedModelError
from rlspec.rollout.runtime.model.families import FAMILIES, family_of_config

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# RoPE variants whose frequencies are fixed at load (rotary.rope_inv_freq computes them as transformers
# does). "dynamic" and "longrope" change frequencies with the sequence length inside the forward: refused.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # llama.MLP computes these exactly as transformers' ACT2FN
GEMMA = ("gemma", "gemma2", "gemma3_text")
_USE_TRL = "use trl.GRPOTrainer's own generation (or vLLM) for this model"


class DeferredConfig:
    """A transformers config that crosses to another process as its class and dict. There a field of the dict is
    read from it; anything else (a method, a field the dict leaves out) rebuilds the config first. Unpickling
    the config itself imports transformers (~2 s), which the drafter trainer's child needs only for the RoPE
    variants computed through transformers."""

    def __init__(self, config: Any):
        self._cls = (type(config).__module__, type(config).__qualname__)
        self._dict = config.to_dict()
        self._config = config

    def __getstate__(self) -> dict:
        return {"_cls": self._cls, "_dict": self._dict, "_config": None}

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not yet set while unpickling (and never the config's)
            raise AttributeError(name)
        if self._config is None and name in self._dict:
            return self._dict[name]
        if self._config is None:
            module, qualname = self._cls
            self._config = getattr(importlib.import_module(module), qualname).from_dict(self._dict)
        return getattr(self._config, name)


@dataclass
class ModelConfig:
    model_type: str  # the family (families.py), which a subclass's own model_type may not be
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
    qk_norm: bool  # Qwen3, Gemma 3
    sliding_window: int | None = None  # the window of the layers `windows` marks (None: no layer slides)
    hf_config: Any = None  # kept for RoPE variants we compute through transformers
    hidden_act: str = "silu"
    windows: tuple[bool, ...] = ()  # per layer: attends within sliding_window (transformers' sliding_attention)
    layer_rope: tuple[str | None, ...] = ()  # per layer: its RoPE table (None: the main one; Gemma 3's local)
    gemma_norm: bool = False  # RMSNorm times (1 + weight), in float32 (Gemma)
    embed_scale: float | None = None  # embeddings times this, rounded to the model dtype (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # norms after attention and before/after the MLP (Gemma 2/3)
    attn_scale: float | None = None  # query scaling; None: head_dim ** -0.5 (Gemma 2/3: query_pre_attn_scalar)
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    final_softcap: float | None = None  # tanh soft-capping of the logits (Gemma 2/3)
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts instead of the dense MLP (Qwen3-MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def portable(self) -> "ModelConfig":
        """This config for another process: its transformers config deferred (DeferredConfig)."""
        hf = self.hf_config
        if hf is None or not hasattr(hf, "to_dict"):
            return self
        return dataclasses.replace(self, hf_config=DeferredConfig(hf))

    @classmethod
    def from_hf(cls, hf: Any, family: str | None = None) -> "ModelConfig":
        """Build from a transformers PretrainedConfig (or anything with the same attributes). family: what
        families.family_of_model found for a live model; None: the config's model_type must name one."""
        mt = family or family_of_config(hf)
        check_rope(hf, mt)
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attn_bias = bool(getattr(hf, "attention_bias", False))
        gemma = mt in GEMMA
        if mt in ("gemma3_text", "gemma2") and getattr(hf, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{mt} with use_bidirectional_attention is not causal; {_USE_TRL}")
        act = getattr(hf, "hidden_activation", None) if mt in ("gemma2", "gemma3_text") else None
        act = act or getattr(hf, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {act!r} is not computed by rlspec's runtime ({ACTIVATIONS}); "
                                        f"{_USE_TRL}")
        windows, window = layer_windows(hf, mt)
        per_type_rope = mt == "gemma3_text" and _per_layer_type(_rope_params(hf))
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
            qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=window,
            hf_config=hf,
            hidden_act=act,
            windows=windows,
            layer_rope=tuple(t if t != main_rope_type(hf) else None for t in hf.layer_types) if per_type_rope else (),
            gemma_norm=gemma,
            embed_scale=math.sqrt(hf.hidden_size) if gemma else None,
            sandwich_norms=mt in ("gemma2", "gemma3_text"),
            attn_scale=hf.query_pre_attn_scalar ** -0.5 if mt in ("gemma2", "gemma3_text") else None,
            # Gemma 3's attention ignores attn_logit_softcapping (transformers never passes it on)
            attn_softcap=getattr(hf, "attn_logit_softcapping", None) if mt == "gemma2" else None,
            final_softcap=getattr(hf, "final_logit_softcapping", None) if gemma else None,
            **moe_fields(hf, mt),
        )


def moe_fields(hf: Any, family: str) -> dict:
    """Qwen3-MoE's routed layers, as Qwen3MoeDecoderLayer picks them; {} for dense families."""
    if family != "qwen3_moe":
        return {}
    n, step, dense = hf.num_experts, hf.decoder_sparse_step, set(hf.mlp_only_layers or ())
    return dict(moe_layers=tuple(i not in dense and n > 0 and (i + 1) % step == 0 for i in range(hf.num_hidden_layers)),
                num_experts=n, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob))


def _rope_params(hf: Any) -> dict:
    return getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}


def _per_layer_type(params: dict) -> bool:
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def main_rope_type(hf: Any) -> str | None:
    """The layer type whose RoPE is the model's main table (rope_cos/rope_sin); None without per-type RoPE."""
    params = _rope_params(hf)
    if not _per_layer_type(params):
        return None
    return "full_attention" if "full_attention" in params else sorted(params)[0]


def check_rope(hf: Any, family: str) -> None:
    """Refuse RoPE variants the runtime would compute differently from transformers, by name."""
    params = _rope_params(hf)
    if _per_layer_type(params):
        if family != "gemma3_text":  # only Gemma 3's modeling reads a RoPE per layer type
            raise UnsupportedModelError(f"per-layer-type RoPE parameters ({sorted(params)}) are not supported by "
                                        f"rlspec's runtime for {family}; {_USE_TRL}")
        missing = sorted(set(getattr(hf, "layer_types", ())) - set(params))
        if missing:
            raise UnsupportedModelError(f"no RoPE parameters for layer types {missing}; {_USE_TRL}")
        kinds = list(params.values())
    else:
        kinds = [params]
    for p in kinds:
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} is not supported by rlspec's runtime (it computes {STATIC_ROPE_TYPES}; "
                f"'dynamic' and 'longrope' rescale with the sequence length during the forward); {_USE_TRL}")


def layer_windows(hf: Any, family: str) -> tuple[tuple[bool, ...], int | None]:
    """(per layer: slides, the window) exactly as the family's transformers modeling decides. Mistral and
    Qwen3-MoE slide every layer when sliding_window is set (their configs null it when use_sliding_window is
    off); Qwen2, Qwen3 and Gemma 2/3 follow layer_types (Qwen2/Qwen3 derive it from use_sliding_window and
    max_window_layers); Llama and Gemma 1 never slide. A window covering every position
    (max_position_embeddings) is kept: it costs a mask, never a wrong token. Unknown layer types are refused."""
    types = list(getattr(hf, "layer_types", None) or [])
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"attention layer types {unknown} are not supported by rlspec's runtime "
                                    f"(full and sliding attention only); {_USE_TRL}")
    window = getattr(hf, "sliding_window", None)
    L = hf.num_hidden_layers
    if family in ("llama", "gemma") or not window:
        return (), None
    if family in ("mistral", "qwen3_moe"):  # their modeling reads sliding_window alone, for every layer
        return (True,) * L, window
    slides = tuple(t == "sliding_attention" for t in types[:L])
    return (slides, window) if any(slides) else ((), None)
