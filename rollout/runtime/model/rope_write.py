"""The rotation of a step's q and k heads and the writes of its keys and values to the KV pool, as one Triton
kernel on CUDA (16-bit models): what rotary.rope and two kv_cache.write_slots do in six kernels (a roll, two
products and a sum, two scatters), bit for bit (each product and the sum rounded to the model's dtype, as torch's
16-bit ops round them; docs/gpu.md#where-a-step-goes).

A learned drafter's layer, whose q and k come from separate products, rotates both in one kernel too
(`rotate_pair`, eight kernels before). The same kernels run on CPU tensors through Triton's interpreter
(tests/rollout/runtime/test_rope_write.py); the engine calls them on CUDA only (fused_ops.step_rotation,
fused_ops.rotate_pair)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlspec.rollout.runtime.model import pdl
from rlspec.rollout.runtime.model.pdl import dependent_start


@triton.jit
def round_to(f, dtype: tl.constexpr, BF16: tl.constexpr):
    """float32 f rounded to dtype, to nearest even as torch rounds; bf16 through its bits (Triton's interpreter
    truncates a bf16 conversion), NaN kept NaN."""
    if BF16:
        bits = f.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(f != f, f.to(tl.bfloat16), out)
    return f.to(dtype)


@triton.jit
def rotated(head, d, ok, cos, sin, D: tl.constexpr, BF16: tl.constexpr):
    """The head at `head` rotated, HF's x * cos + rotate_half(x) * sin as torch's 16-bit ops round it (each
    product, then the sum); rotate_half(x) * sin is roll(x, D/2) times the signed sin (llama.rope)."""
    x = tl.load(head + d, mask=ok, other=0.0)
    rolled = tl.load(head + (d + D // 2) % D, mask=ok, other=0.0)
    a = round_to(x.to(tl.float32) * cos, x.dtype, BF16).to(tl.float32)
    b = round_to(rolled.to(tl.float32) * sin, x.dtype, BF16).to(tl.float32)
    return round_to(a + b, x.dtype, BF16)


@triton.jit
def _rope_write(QKV, Cos, Sin, Slots, Kp, Vp, Q, s_x, s_xh, s_c, s_s, s_q, s_qh, s_ks, s_kh, s_vs, s_vh,
                NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BF16: tl.constexpr,
                PDL: tl.constexpr):
    """One (token, head) of the fused q|k|v product: a q head rotated into Q, a k head rotated into its pool slot,
    a v head copied into its pool slot. PDL: launched dependent on the kernel before (pdl.py)."""
    dependent_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, DP)
    ok = d < D
    if h >= NH + NKV:
        slot = tl.load(Slots + t)
        tl.store(Vp + slot * s_vs + (h - NH - NKV) * s_vh + d, tl.load(QKV + t * s_x + h * s_xh + d, mask=ok), mask=ok)
    else:
        cos = tl.load(Cos + t * s_c + d, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(Sin + t * s_s + d, mask=ok, other=0.0).to(tl.float32)  # signed: its first half negated
        y = rotated(QKV + t * s_x + h * s_xh, d, ok, cos, sin, D, BF16)
        if h < NH:
            tl.store(Q + t * s_q + h * s_qh + d, y, mask=ok)
        else:
            slot = tl.load(Slots + t)
            tl.store(Kp + slot * s_ks + (h - NH) * s_kh + d, y, mask=ok)


@triton.jit
def _rope_pair(Q, K, Cos, Sin, QO, KO, s_q, s_qh, s_k, s_kh, s_c, s_s, s_qo, s_qoh, s_ko, s_koh,
               NH: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    """One (token, head) of separate q and k products (a drafter's layer): the head rotated into QO or KO."""
    dependent_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, DP)
    ok = d < D
    cos = tl.load(Cos + t * s_c + d, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(Sin + t * s_s + d, mask=ok, other=0.0).to(tl.float32)
    if h < NH:
        tl.store(QO + t * s_qo + h * s_qoh + d, rotated(Q + t * s_q + h * s_qh, d, ok, cos, sin, D, BF16), mask=ok)
    else:
        y = rotated(K + t * s_k + (h - NH) * s_kh, d, ok, cos, sin, D, BF16)
        tl.store(KO + t * s_ko + (h - NH) * s_koh + d, y, mask=ok)


def rotate_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, T, nh, D] and k [B, T, nkv, D] rotated (rotary.rope of each), cos/sin [B, T, 1, D] -> (q, k), new
    tensors: what a learned drafter's layer does in eight kernels (two rotations of four)."""
    B, T, nh, D = q.shape
    nkv = k.shape[2]
    qi, ki = q.reshape(B * T, nh, D), k.reshape(B * T, nkv, D)
    c, s = cos.reshape(B * T, D), sin.reshape(B * T, D)
    if qi.stride(2) != 1 or ki.stride(2) != 1 or c.stride(1) != 1 or s.stride(1) != 1:
        qi, ki, c, s = qi.contiguous(), ki.contiguous(), c.contiguous(), s.contiguous()
    qo, ko = torch.empty(B * T, nh, D, dtype=q.dtype, device=q.device), torch.empty(B * T, nkv, D, dtype=k.dtype,
                                                                                      device=k.device)
    _rope_pair[(B * T, nh + nkv)](qi, ki, c, s, qo, ko, qi.stride(0), qi.stride(1), ki.stride(0), ki.stride(1),
                                  c.stride(0), s.stride(0), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
                                  NH=nh, D=D, DP=triton.next_power_of_2(D), BF16=q.dtype == torch.bfloat16,
                                  **pdl.launch(pdl.serves(q)))
    return qo.view(B, T, nh, D), ko.view(B, T, nkv, D)


def rotate_and_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, slots: torch.Tensor, nh: int, nkv: int) -> torch.Tensor:
    """qkv [B, T, nh + 2 nkv, D] (the fused product), cos/sin [B, T, 1, D] (sin signed: rotary.rope_table), pools
    [num_blocks, block_size, nkv, D], slots [B, T] flat pool slots -> q [B, T, nh, D] rotated; k rotated and v
    written to the pools at the slots."""
    B, T, heads, D = qkv.shape
    x, c, s = qkv.reshape(B * T, heads, D), cos.reshape(B * T, D), sin.reshape(B * T, D)
    if x.stride(2) != 1 or c.stride(1) != 1 or s.stride(1) != 1:
        x, c, s = x.contiguous(), c.contiguous(), s.contiguous()
    slot = slots.reshape(-1).contiguous()  # read side by side (a [B, 1] column of a wider tensor views with a stride)
    kf, vf = k_pool.view(-1, nkv, D), v_pool.view(-1, nkv, D)  # the pools by flat slot
    q = torch.empty(B, T, nh, D, dtype=qkv.dtype, device=qkv.device)
    _rope_write[(B * T, heads)](x, c, s, slot, kf, vf, q, x.stride(0), x.stride(1), c.stride(0), s.stride(0),
                              q.stride(1), q.stride(2), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
                              NH=nh, NKV=nkv, D=D, DP=triton.next_power_of_2(D), BF16=qkv.dtype == torch.bfloat16,
                              **pdl.launch(pdl.serves(qkv)))
    return q
