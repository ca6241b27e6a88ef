"""A product of a few rows (a decode step's, a verify's of a few rows) as one Triton kernel on CUDA: x W^T (+ bias)
(+ a residual), summed in float32 and rounded once to x's dtype; optionally of x RMS-normalised first (the norm
before a layer's q|k|v and gate|up products, and the final one before the LM head), or of SiLU times up of an MLP's
gate|up product (before its down product): one kernel where two were.

Why: at 1-64 rows a product streams its weight once and does little else, so its time is the weight's bytes over
the bandwidth it reaches. On the H200 cuBLAS reached 59-63% of the bandwidth for a Qwen2.5-7B layer's two small
products (q|k|v, 33 MB; o, 26 MB) and 78-80% for its MLP's (bench_out/gpu_2026-11-30/profile.json): 3.8 ms of a
6.3 ms step against 2.95 ms at the full bandwidth. Here each program streams BN whole rows of W, BK columns at a
time, so a product of N outputs runs N / BN programs a tile of 16 rows and no second pass (K is not split, whose
partial sums would need another kernel). The row tiles of more than 16 rows (up to four) are adjacent programs,
which run together: the later ones read their W from the L2 cache the first filled, not from memory. The bias and
the layer's residual are added in float32 as the result is stored, one rounding, as addmm adds a residual.

Each row's result depends on that row alone: every row is summed in the same order whatever the other rows are
(rows past M are masked: their x reads 0 and nothing of them is stored; every tile of 16 rows is a program of its
own, so a row's sum is the same whether 1, 16 or 64 rows run). So a verify
of T tokens and a decode step give a token's product the same bits, which cuBLAS, choosing its kernel by the
row count, does not. Whether this kernel or cuBLAS serves a shape is measured on the device
(fused_ops.product); the same kernel runs on CPU tensors through Triton's interpreter
(tests/rollout/runtime/test_few_rows.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlspec.rollout.runtime.model import pdl
from rlspec.rollout.runtime.model.pdl import dependent_start
from rlspec.rollout.runtime.model.rope_write import round_to
from rlspec.rollout.runtime.model.silu_mul import silu_times_up

TILE_ROWS = 16  # rows a program: the dot's smallest tile
MAX_ROWS = 64  # four tiles' programs read W once between them (the L2 cache); more rows are a GEMM's (cuBLAS)
STAGES = 3  # Triton's software pipeline: W's next tile loads while one is summed (4: two ahead, 1.5x the shared memory)


@triton.jit(do_not_specialize=["M"])  # one compile for 1-64 rows (Triton would specialise M == 1 and 16s)
def _few_rows(X, W, Bias, Res, Norm, Y, M, N, K, s_xm, s_wn, s_rm, s_ym, eps, HAS_BIAS: tl.constexpr,
              HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, GATED: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr):
    """Outputs n0..n0+BN (program_id(1)) of the rows m0..m0+BM-1 below M (program_id(0), the grid's faster axis:
    a product's row tiles of the same outputs are neighbours in the launch order). HAS_NORM: x is RMS-normalised
    first (weight Norm [K], as torch's fused rms_norm: x * rsqrt(mean(x^2) + eps) * weight in float32, rounded to
    x's dtype), each program summing its rows' squares itself (a few rows of K: from the L2 cache). GATED: X holds
    an MLP's gate|up product [M, 2K] and x is silu(gate) * up, computed as it loads (silu_mul.py's bits). F32: the dot
    takes float32 operands at full precision (a float32 model, and 16-bit ones in Triton's interpreter, which
    multiplies 16-bit operands wrongly; their products are exact in float32). PDL: launched dependent on the kernel
    before (pdl.py)."""
    dependent_start(PDL)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    kk = tl.arange(0, BK)
    n_ok, m_ok = n < N, m < M
    if HAS_NORM:
        squares = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + kk
            x = tl.load(X + m[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            x = x.to(tl.float32)
            squares += tl.sum(x * x, 1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + kk
        k_ok = k < K
        x_ok = m_ok[:, None] & k_ok[None, :]
        x = tl.load(X + m[:, None] * s_xm + k[None, :], mask=x_ok, other=0.0)
        if GATED:
            x = silu_times_up(x, tl.load(X + m[:, None] * s_xm + K + k[None, :], mask=x_ok, other=0.0), BF16)
        if HAS_NORM:
            scale = tl.load(Norm + k, mask=k_ok, other=0.0).to(tl.float32)
            x = round_to(x.to(tl.float32) * rstd[:, None] * scale[None, :], X.dtype.element_ty, BF16)
        w = tl.load(W + n[:, None] * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        acc += tl.load(Res + m[:, None] * s_rm + n[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + m[:, None] * s_ym + n[None, :], round_to(acc, Y.dtype.element_ty, BF16), mask=ok)


def tiles(N: int, K: int, gated: bool = False, normed: bool = False) -> tuple[int, int]:
    """(BN, BK): 16 rows of W a program up to 16,384 outputs (a 7B layer's q|k|v, o and down: 224-288 programs,
    about two for each of a large GPU's SMs), 32 above (its gate|up: 1,184; the LM head: 4,752); 512 columns a load
    once K allows (16-32 KB of W a load), 256 gated (SiLU of a 16 x 512 gate tile and its up tile took more
    registers than a thread has, spilling: tests/rollout/runtime/triton_aot.py) and normed (the norm's weight tile
    beside x's and W's made a program of 32 outputs 114 KB of shared memory at 512, one program an SM on an H200
    where the plain product runs two: it timed 161 us against the plain product's 70 there, 2026-12-04; 57 KB at
    256)."""
    return (16 if N <= 16384 else 32), min(256 if gated or normed else 512, max(64, triton.next_power_of_2(K)))


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 0.0,
            gated: bool = False, stages: int = STAGES) -> torch.Tensor:
    """x [..., K] of at most MAX_ROWS rows, weight [N, K] -> x W^T (+ bias [N]) (+ residual [..., N]), [..., N];
    with norm [K], rms_norm(x, norm, eps) W^T (...); gated, x [..., 2K] an MLP's gate|up product and the product
    silu(gate) * up W^T (...). stages: the launch's pipeline depth, which changes no bit of the result (the same
    tiles summed in the same order) and which fused_ops times per shape."""
    N, K = weight.shape
    if x.shape[-1] != (2 * K if gated else K) or (gated and norm is not None):
        raise ValueError(f"few_rows.product: x [..., {x.shape[-1]}] against a weight [{N}, {K}]"
                         f"{' (gated: x is gate|up, 2K wide; no norm)' if gated else ''}")
    rows = x.reshape(-1, x.shape[-1])
    M = rows.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"few_rows.product takes at most {MAX_ROWS} rows, got {M}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    res = y if residual is None else residual.reshape(M, N)
    if res.stride(-1) != 1:
        res = res.contiguous()
    BN, BK = tiles(N, K, gated, norm is not None)
    _few_rows[(triton.cdiv(M, TILE_ROWS), triton.cdiv(N, BN))](
        rows, weight, y if bias is None else bias, res, y if norm is None else norm, y, M, N, K, rows.stride(0),
        weight.stride(0), res.stride(0), y.stride(0), float(eps), HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, HAS_NORM=norm is not None, GATED=gated, BM=TILE_ROWS, BN=BN, BK=BK,
        BF16=x.dtype == torch.bfloat16, F32=x.dtype == torch.float32 or x.device.type != "cuda", num_warps=4,
        num_stages=stages, **pdl.launch(pdl.serves(x)))
    return y.view(*x.shape[:-1], N)
