"""SiLU of the gate times the up projection, silu(gate) * up, as one Triton kernel on CUDA (16-bit models): what
torch does in two kernels (the activation, then the product), each a node of every CUDA graph
(docs/gpu.md#where-a-step-goes). Each result is rounded to the model's dtype as torch rounds it (the activation in
float32, then the product). The exponential is Triton's, not CUDA's expf, so a bf16 result can differ from
torch's in its last bit, as the fused norm's (llama.fused_norm) can.

The same kernel runs on CPU tensors through Triton's interpreter (tests/rollout/runtime/test_silu_mul.py); the
engine calls it on CUDA only (fused_ops.activation_product)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlspec.rollout.runtime.model import pdl
from rlspec.rollout.runtime.model.pdl import dependent_start
from rlspec.rollout.runtime.model.rope_write import round_to

BLOCK = 1024  # columns of the intermediate width a program takes


@triton.jit
def silu_times_up(gate, up, BF16: tl.constexpr):
    """silu(gate) * up of 16-bit tiles, each rounded as torch rounds it: this kernel's, and the down product's when
    few_rows.py computes its x as it loads it (the same bits)."""
    g = gate.to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), gate.dtype, BF16).to(tl.float32)
    return round_to(act * up.to(tl.float32), gate.dtype, BF16)


@triton.jit
def _silu_mul(GU, Out, s_gu, s_out, inter, BF16: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row's BLOCK columns: gate = GU[row, col], up = GU[row, inter + col] -> Out[row, col]. PDL: launched
    dependent on the kernel before (pdl.py)."""
    dependent_start(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < inter
    gate = tl.load(GU + row * s_gu + col, mask=ok, other=0.0)
    up = tl.load(GU + row * s_gu + inter + col, mask=ok, other=0.0)
    tl.store(Out + row * s_out + col, silu_times_up(gate, up, BF16), mask=ok)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """gate_up [..., 2 inter] (the fused gate|up product) -> silu(gate) * up [..., inter]."""
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul[(rows.shape[0], triton.cdiv(inter, BLOCK))](rows, out, rows.stride(0), out.stride(0), inter,
                                                          BF16=gate_up.dtype == torch.bfloat16, BLOCK=BLOCK,
                                                          **pdl.launch(pdl.serves(gate_up)))
    return out.view(*gate_up.shape[:-1], inter)
