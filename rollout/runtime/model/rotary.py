"""Rotary position embeddings as HF computes them: the cos and signed sin tables per position (`rope_table`) and
the rotation of heads by them (`rope`), bit for bit transformers' result."""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.model.config import ModelConfig, main_rope_type


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """HF's rotation x * cos + rotate_half(x) * sin of the first `heads` heads of x [B, T, heads+, D] (all: None),
    bit for bit, given the signed sin of our tables (`rope_table`: its first half negated). rotate_half(x) * sin
    is then roll(x, D/2) * sin, since a negation is exact and commutes with the product's rounding: 4 kernels
    where HF's rotation takes 5, and as the q and k heads of the fused q|k|v product are adjacent, one rotation
    serves both (10 kernels before; each is a node of every CUDA graph, docs/gpu.md#where-a-step-goes)."""
    rolled = torch.roll(x, x.shape[-1] // 2, -1)  # x contiguous: one kernel (roll copies a strided input first)
    if heads is not None:
        x, rolled = x[:, :, :heads], rolled[:, :, :heads]
    return x * cos + rolled * sin


def rope_table(cfg: ModelConfig, max_len: int, device, layer_type: str | None = None):
    """(cos, signed sin) [max_len, hd] float32 for one layer type's RoPE (None: the main one), as HF per position,
    the sin's first half negated: what `rope` multiplies the rolled heads by."""
    inv_freq, scaling = rope_inv_freq(cfg, layer_type)
    freqs = torch.arange(max_len, dtype=torch.float32, device=device)[:, None] * inv_freq.to(device)[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin() * scaling
    sin[:, :freqs.shape[1]].neg_()
    return emb.cos() * scaling, sin


def rope_inv_freq(cfg: ModelConfig, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling; non-default RoPE types go through transformers. With RoPE
    parameters per layer type (Gemma 3), layer_type None is the main type (config.main_rope_type)."""
    hf = cfg.hf_config
    params = getattr(hf, "rope_parameters", None) or {}
    kind = layer_type or main_rope_type(hf)
    if kind is not None and isinstance(params.get(kind), dict):
        params = params[kind]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params["rope_theta"] if "rope_theta" in params else getattr(hf, "rope_theta", 10000.0)
        dim = cfg.head_dim
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    extra = {"layer_type": kind} if kind is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **extra)
    return inv_freq.float(), float(scaling)
