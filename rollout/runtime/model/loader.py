"""Load Hugging Face Llama-family weights into our runtime, from a directory or a live model.

HF keeps q/k/v and gate/up as separate matrices; our runtime fuses them. `load_named_tensors`
is the one place that maps names, used at load time and for every policy weight sync.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from rollout.errors import ModelNotFoundError
from rollout.runtime.model.config import ModelConfig
from rollout.runtime.model.llama import LlamaForCausalLM

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _fused_slot(cfg: ModelConfig, name: str) -> tuple[str, int, int] | None:
    """For an HF q/k/v/gate/up name, the fused parameter name and the row range it fills."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    table = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0, q),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", q, q + kv),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", q + kv, q + 2 * kv),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0, inter),
        "mlp.up_proj.": ("mlp.gate_up_proj.", inter, 2 * inter),
    }
    for hf_part, (ours, start, stop) in table.items():
        if hf_part in name:
            return name.replace(hf_part, ours), start, stop
    return None


@torch.no_grad()
def load_named_tensors(model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy HF-named tensors into the runtime (dtype/device converted). Returns how many were loaded.

    Unknown names raise: a silently skipped tensor is how weight syncs corrupt a rollout engine.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    count = 0
    for name, tensor in named_tensors:
        name = name.removeprefix("module.")
        if "rotary_emb" in name:
            continue
        fused = _fused_slot(model.cfg, name)
        if fused is not None:
            target, start, stop = fused
            params[target][start:stop].copy_(tensor)
        elif name in params:
            if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                continue  # tied: the embedding already holds it
            params[name].copy_(tensor)
        else:
            raise KeyError(f"weight {name!r} has no place in rlspec's runtime ({model.cfg.model_type}); "
                           "is the checkpoint a Llama/Qwen2/Qwen3 causal LM?")
        count += 1
    return count


def build_model(hf_config, dtype: torch.dtype, device: str | torch.device) -> LlamaForCausalLM:
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)  # cast on meta: no float32 copy of the weights is ever made
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_model(path: str, dtype: str | torch.dtype = "bfloat16", device="cpu") -> LlamaForCausalLM:
    """Load a local HF directory (config.json + *.safetensors) into our runtime."""
    from safetensors import safe_open
    from transformers import AutoConfig

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {path!r}; pass a Hugging Face model directory")
    model = build_model(AutoConfig.from_pretrained(path), resolve_dtype(dtype), device)
    loaded = 0
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            loaded += load_named_tensors(model, ((k, st.get_tensor(k)) for k in st.keys()))
    _check_complete(model, loaded)
    return model


def from_hf_model(hf_model, dtype: torch.dtype | None = None, device=None) -> LlamaForCausalLM:
    """Build our runtime from an in-memory transformers model (weights copied, not shared)."""
    p = next(hf_model.parameters())
    model = build_model(hf_model.config, dtype or p.dtype, device or p.device)
    loaded = load_named_tensors(model, hf_model.state_dict().items())
    _check_complete(model, loaded)
    return model


def _check_complete(model: LlamaForCausalLM, loaded: int) -> None:
    cfg = model.cfg
    per_layer = 9 + (3 if cfg.qkv_bias else 0) + (1 if cfg.o_bias else 0) + (3 if cfg.mlp_bias else 0)
    per_layer += 2 if cfg.qk_norm else 0
    expected = cfg.num_layers * per_layer + 2 + (0 if cfg.tie_word_embeddings else 1)
    if loaded < expected:
        raise ValueError(f"checkpoint held {loaded} of the {expected} tensors the model needs; it is incomplete")

