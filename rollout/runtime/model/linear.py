"""Linear: nn.Linear with the CPU's fast paths for the products a decode step makes.

A decode step at small batch streams every weight once (bandwidth-bound). On this CPU torch's bf16
matmul streams them at only ~8 GB/s on one core, because oneDNN reorders the weight into its blocked
layout on every call; two ways around it (`python -m rlspec.bench step` measures them in place):
  * packed weights (eager steps, CPU, bf16): the weight reordered once into oneDNN's layout
    (`pack_linears`), and every call runs oneDNN on it: 1.8-2x faster at 1 to 16 rows, with the same
    kernel and so bit for bit the same output as F.linear. A packed copy is refreshed when the weight
    changes in place (its version counter or storage moved: a policy sync, an optimizer step); writes
    through `.data`, which bypass the version counter, are not seen, and nothing in rlspec makes them.
  * 1-16 rows inside a compiled CPU step (a decode step of up to 8 rows, a verify at batch 1):
    kernels.packed_linear, our AVX-512 BF16 kernel, which streams the weight once for all rows from a blocked
    copy of it (`_blocked`, one contiguous stream per block of 8 rows: 1.15-1.35x the bandwidth of the
    row-major weight at 1-4 rows, bench_out/kernel_stream.json; kernels/small_gemm.cpp). Without the
    kernel, a single row takes `(x * W).sum(-1)`, a reduction inductor vectorises and fuses (it reads the
    weight once per row), and steps of several rows run eagerly on the packed weights (runtime/compiled.py).
    Accumulation is float32 and the output is rounded once to the input dtype, as in the matmul.
    `fast_linear` gives a plain nn.Linear (the learned drafter's) the same kernel outside autograd.
  * float32 weights, 2-128 rows, eager (where no other path serves: MKL's sgemm): the product taken weight-major,
    `W @ x^T`, then laid out row-major again. In torch's own layout (`x @ W^T`) MKL streams the weights of a
    decode step from memory at ~2-3 GB/s at 2-16 rows; weight-major, the same products run 1.1-2.9x faster at
    2-128 rows, and the float32 decode step at batch 8 1.6x (`python -m rlspec.bench linear`). It is the same
    product summed in another order: a few ulps off F.linear, as another BLAS would be. A single row keeps F.linear
    (MKL's gemv), and so do products of more than 128 rows (a long prompt's prefill), where torch's layout is as
    fast or faster, and weights under 1 MiB, which stay in cache (docs/runtime.md#float32-products-of-a-few-rows).
Both copies follow the weight: the eager path checks its key at every call; compiled steps cannot (a check
there would be a guard), so the runner refreshes every copy at the start of each generate call
(`refresh_linears`), and the blocked copy is rewritten in place (compiled steps hold it).
CUDA and training never take any of these paths (on CUDA a product of a few rows may take our Triton kernel instead,
fused_ops.product); `unpack_linears` returns a model to F.linear alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlspec.rollout.runtime.model import fused_ops, kernels


class Linear(nn.Linear):
    # copies of the weight (not parameters: not synced, not saved), made from the weight whose (version, storage)
    # is _packed_key: oneDNN's layout for eager steps, the kernel's blocked layout for compiled ones
    _packed: torch.Tensor | None = None
    _blocked: torch.Tensor | None = None
    _packed_key: tuple = ()
    plain = False  # unpack_linears: F.linear only, the reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if kernels.usable(x, self.weight):  # 1-16 rows: each weight streamed once for all of them
                if self._blocked is not None:
                    return kernels.packed_linear(x, self._blocked, self.bias, self.out_features)
                return kernels.small_linear(x, self.weight, self.bias)
            if x.device.type == "cpu" and x.shape[:-1].numel() == 1:
                y = (x[..., None, :].float() * self.weight.float()).sum(-1)  # [..., out]
                if self.bias is not None:
                    y = y + self.bias.float()
                return y.to(x.dtype)
            return F.linear(x, self.weight, self.bias)
        if self._packed is not None:
            self.refresh()
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [None], "")
        if not self.plain and weight_major(x, self.weight):
            return weight_major_linear(x, self.weight, self.bias)
        if self.plain or not x.is_cuda:
            return F.linear(x, self.weight, self.bias)
        return fused_ops.product(x, self.weight, self.bias)  # a few rows may take our kernel (few_rows.py)

    def pack(self, blocked: bool = False) -> None:
        """Make (or remake) the copies from the weight as it is now; blocked: also the kernel's copy (kept, and
        rewritten in place, once it exists)."""
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            if blocked or self._blocked is not None:
                self._blocked = kernels.pack(self.weight, self._blocked)
        self._packed_key = _key(self.weight)

    def refresh(self) -> None:
        """Remake the copies if the weight changed since they were made (a policy sync, an optimizer step)."""
        if self._packed is not None and self._packed_key != _key(self.weight):
            self.pack()


WEIGHT_MAJOR_ROWS = (2, 128)  # from 256 rows on, torch's layout is as fast or faster (bench linear)
WEIGHT_MAJOR_MIN = 1 << 18  # elements (1 MiB): a smaller weight stays in cache, where the two extra ops cost more
_MKL = torch.backends.mkl.is_available()


def weight_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ W^T is taken as W @ x^T (module docstring): a float32 CPU product of 2-128 rows with a weight of
    1 MiB or more, outside autograd, where MKL computes it."""
    lo, hi = WEIGHT_MAJOR_ROWS
    return (_MKL and weight.dtype == torch.float32 and weight.numel() >= WEIGHT_MAJOR_MIN
            and x.device.type == "cpu" and x.dtype == torch.float32 and lo <= x.shape[:-1].numel() <= hi
            and not torch.is_grad_enabled())


def weight_major_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T, laid out row-major (contiguous) again."""
    rows = x.reshape(-1, x.shape[-1]).t()
    y = torch.mm(weight, rows) if bias is None else torch.addmm(bias[:, None], weight, rows)
    return y.t().contiguous().view(*x.shape[:-1], weight.shape[0])


def _key(w: torch.Tensor) -> tuple:
    return w._version, w.data_ptr()


def packable(model: nn.Module) -> bool:
    """A CPU bf16 model on a CPU whose oneDNN has a bf16 path (AVX512-BF16 or AMX): elsewhere oneDNN refuses to
    reorder a bf16 weight, and F.linear is the path."""
    p = next(model.parameters())
    return (p.device.type == "cpu" and p.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def pack_linears(model: nn.Module, blocked: bool = False) -> int:
    """Give every Linear of a CPU bf16 model its packed weight, and with `blocked` (steps are compiled) the
    kernel's blocked copy where the kernel is available (see the module docstring); returns the bytes the copies
    take (the KV budget, sized later, sees them). A no-op elsewhere."""
    if not packable(model):
        return 0
    blocked = blocked and kernels.available()
    dtype = next(model.parameters()).dtype
    total = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.weight.dtype == dtype:  # a float32 head (loader.cast_head) stays plain
            m.pack(blocked)
            copies = [c for c in (m._packed, m._blocked) if c is not None]
            total += sum(c.numel() * c.element_size() for c in copies)
    return total


def refresh_linears(model: nn.Module) -> None:
    """Bring every packed copy up to date with its weight (the engine calls it as a generate call starts)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.refresh()


def unpack_linears(model: nn.Module) -> None:
    """Drop the packed copies and the weight-major products: every Linear runs F.linear again (the reference in
    tests and benchmarks)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m._packed = m._blocked = None
            m.plain = True


def fast_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for a plain nn.Linear outside autograd, through the bf16 few-row kernel where it serves x (a
    learned drafter's step: one to a few rows, whose unpacked oneDNN products reorder every weight at each
    call, ~8 GB/s); layer(x) everywhere else, and always when gradients are on (training the drafter). The
    kernel reads a blocked copy of the weight, made again whenever the weight changed (new drafter weights). On
    CUDA, outside autograd, the product of a few rows may take our Triton kernel (fused_ops.product), which reads
    the weight as it is."""
    if not torch.is_grad_enabled() and kernels.usable(x, layer.weight):
        key, blocked = getattr(layer, "_rlspec_blocked", ((), None))
        if key != _key(layer.weight):
            blocked = kernels.pack(layer.weight)
            layer._rlspec_blocked = (_key(layer.weight), blocked)
        return kernels.packed_linear(x, blocked, layer.bias, layer.out_features)
    if x.is_cuda and not torch.is_grad_enabled():
        return fused_ops.product(x, layer.weight, layer.bias)
    return layer(x)
