"""Qwen3-MoE's routed experts, computed as transformers' Qwen3MoeSparseMoeBlock (eager experts) computes them.

Router: logits in the model dtype, softmax in float32, top-k, optionally renormalised (norm_topk_prob), cast
back. Experts: one loop over the experts some token chose, in expert order, each adding its weighted output
into a zero tensor (index_add_), so the sums happen in transformers' order. Parameter names and layouts are
transformers' (mlp.gate.weight [E, H]; mlp.experts.gate_up_proj [E, 2I, H], gate rows first; down_proj
[E, H, I]), so loader.py maps them one to one.

The loop's length and the tokens per expert depend on the routing: the step cannot be captured in a CUDA graph
(engine.py runs MoE models eagerly) and each step reads which experts were hit (one host sync per layer).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    def __init__(self, num: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))


class SparseMoE(nn.Module):
    def __init__(self, cfg, act):
        """cfg: ModelConfig (its MoE fields); act: the experts' activation (llama.ACTIVATIONS)."""
        super().__init__()
        E, H = cfg.num_experts, cfg.hidden_size
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = Experts(E, H, cfg.moe_intermediate_size)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a routed-experts layer cannot be captured in a CUDA graph (its loop depends on the "
                               "routing); run MoE models with graph_mode='off'")
        shape, E = x.shape, self.experts.gate_up_proj.shape[0]
        h = x.reshape(-1, shape[-1])
        logits = self.gate(h)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(h)
        hit = F.one_hot(chosen, E).permute(2, 1, 0)  # [E, k, N]
        for e in hit.sum(dim=(1, 2)).nonzero()[:, 0].tolist():
            slot, token = torch.where(hit[e])
            gate, up = F.linear(h[token], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.experts.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(shape)
