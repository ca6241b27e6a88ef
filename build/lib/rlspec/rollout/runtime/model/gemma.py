"""The pieces Gemma (1, 2, 3 text) computes differently from Llama, each as transformers' Gemma modules do.

llama.py builds them only when ModelConfig's Gemma switches are on, so Llama-family models run none of this.
"""
from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: weight stored zero-centred, applied as (1 + weight) in float32 before the cast back
    (Llama's casts first, then scales), as transformers' Gemma*RMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Embeddings times sqrt(hidden) rounded to the weight dtype first (transformers keeps the scale as a
    buffer cast to the model dtype: 55.4256 becomes 55.5 in bfloat16). Being the embedding module itself, every
    reader of `model.embed_tokens` (EAGLE-3's drafter, hidden state 0) sees the scaled vectors, as in transformers."""

    def __init__(self, num: int, dim: int, scale: float):
        super().__init__(num, dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        # a Python float multiplies like transformers' 0-dim tensor of the same (rounded) value
        return x * torch.tensor(self.scale, dtype=x.dtype).item()


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in x's dtype (transformers' attention and final logit soft-capping)."""
    return torch.tanh(x / cap) * cap
