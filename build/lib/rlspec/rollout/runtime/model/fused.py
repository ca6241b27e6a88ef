"""The fused CPU step: each decoder layer, and the model's head, as one call of our C++ op
(kernels/decoder_layer.cpp), where a compiled step makes a call into dynamo's and inductor's wrappers per layer.

Why (docs/runtime.md#the-fused-cpu-step): at batch 1 a compiled step spent about as long around its kernels as in
them (cProfile: 7.6 ms of kernels in a 15 ms step; ~150 us of guards, size asserts, allocations and five op
dispatches per layer call, 31 calls a step). The fused op runs the same products (packed_linear on the blocked
weights) and the same attention (paged_attention), and does the norms, RoPE, the KV write, SiLU and the residuals
in float32 rounded where the eager layer rounds; so it needs no compile, no warm-up and no shape buckets.

Where: CPU, bf16, the kernels built (kernels.available), the Llama-shaped layer (RMSNorm, fused q|k|v and
gate|up products, SiLU, optional biases; Llama, Qwen2, SmolLM), and a step that reads the paged pool through
`blocks` with a dense mask (every decode and verify step on a CPU). Everything else (Gemma's norms, q/k norms,
mixtures of experts, soft-capping, prefill) runs as before: compiled or eager.
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.model import kernels
from rlspec.rollout.runtime.model.linear import Linear

enabled = True  # read at each step: tests and benchmarks switch it off to check or time the compiled step
# Most tokens (rows x tokens a row) a fused step takes: its products are compute-bound past a few rows, and at 32
# one-token rows it is still ahead of the eager step on oneDNN's packed weights (50.9 vs 53.8 ms; 29.7 vs 37.5 at
# 16 rows, SmolLM2 on 2 cores), where the compiled step stopped at 8 rows and 16 tokens.
MAX_TOKENS = 32


def cpu_ready(model) -> bool:
    """The op can run this model's tensors: CPU, bf16, the kernels built (the target's, or a drafter's)."""
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.bfloat16 and kernels.available()


def usable(model) -> bool:
    """Whether this model's decode and verify steps can run fused (see the module docstring); they do while
    `enabled`."""
    from rlspec.rollout.runtime.model.llama import MLP, RMSNorm

    cfg = model.cfg
    if not cpu_ready(model) or cfg.head_dim % 32:
        return False
    if cfg.sandwich_norms or cfg.qk_norm or cfg.attn_softcap is not None or cfg.hidden_act != "silu":
        return False
    if not isinstance(model.model.norm, RMSNorm):
        return False
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return all(isinstance(layer.mlp, MLP) for layer in model.model.layers) and \
        all(m._blocked is not None for m in linears)


class FusedLayers:
    """The model's `layer_call` (llama.py) for fused steps: each decoder layer, and the head function, through the
    fused ops. Each layer's weights and sizes are gathered once, here: the blocked copies keep their identity
    (a weight sync rewrites them in place, model/linear.py), and a step then pays one op call per layer."""

    def __init__(self, model):
        self.args = {}
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.args[layer] = (
                layer.input_layernorm.weight, a.qkv_proj._blocked, a.qkv_proj.bias, a.o_proj._blocked, a.o_proj.bias,
                layer.post_attention_layernorm.weight, mlp.gate_up_proj._blocked, mlp.gate_up_proj.bias,
                mlp.down_proj._blocked, mlp.down_proj.bias, a.nh, a.nkv, mlp.inter, layer.input_layernorm.eps,
                a.hd ** -0.5 if a.scale is None else a.scale)

    def __call__(self, fn, *args):
        weights = self.args.get(fn)
        if weights is None:  # the head function (llama._head): norm, lm_head, x, soft-cap
            norm, lm_head, x, cap = args
            if cap is not None:
                return fn(*args)
            return torch.ops.rlspec_kernels.final_head(x, norm.weight, lm_head._blocked, lm_head.out_features,
                                                       norm.eps)
        x, cos, sin, k_cache, v_cache, fb, attn = args
        if fb.blocks is None or attn.dense is None:  # a prefill, or paged FlexAttention: the layer as it is
            return fn(*args)
        return torch.ops.rlspec_kernels.decoder_layer(x, cos, sin, k_cache, v_cache, fb.slots, fb.blocks, attn.dense,
                                                      *weights)
