"""Linear: nn.Linear with the CPU's two fast paths for the products a decode step makes.

A decode step at small batch streams every weight once (bandwidth-bound). On this CPU torch's bf16
matmul streams them at only ~8 GB/s on one core, because oneDNN reorders the weight into its blocked
layout on every call; two ways around it (scripts/bench_step.py measures them in place):
  * packed weights (eager steps, CPU, bf16): the weight reordered once into oneDNN's layout
    (`pack_linears`), and every call runs oneDNN on it: 1.8-2x faster at 1 to 16 rows, with the same
    kernel and so bit for bit the same output as F.linear. A packed copy is refreshed when the weight
    changes in place (its version counter or storage moved: a policy sync, an optimizer step); writes
    through `.data`, which bypass the version counter, are not seen, and nothing in rlspec makes them.
  * one row inside a compiled CPU step (runtime/compiled.py): `(x * W).sum(-1)`, a reduction inductor
    vectorises and fuses, streams the weight at ~15 GB/s (the packed product reaches ~12-13). It reads
    the weight once per row, so only single-row products take it. Accumulation is float32 and the output
    is rounded once to the input dtype, as in the matmul.
  * 2-16 rows inside a compiled CPU step (a verify at batch 1, a decode step of 2-8 rows): kernels.small_linear,
    our AVX-512 BF16 kernel, which streams the weight once for all rows (kernels/small_gemm.cpp); where it is
    unavailable such steps run eagerly on the packed weights (runtime/compiled.py). `fast_linear` gives a
    plain nn.Linear (the learned drafter's) the same kernel outside autograd.
CUDA, float32 weights and training never take any of these paths.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.runtime.model import kernels


class Linear(nn.Linear):
    _packed: torch.Tensor | None = None  # oneDNN copy of the weight (not a parameter: not synced, not saved)
    _packed_key: tuple = ()  # (version, storage) of the weight it was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if x.device.type == "cpu" and x.shape[:-1].numel() == 1:
                y = (x[..., None, :].float() * self.weight.float()).sum(-1)  # [..., out]
                if self.bias is not None:
                    y = y + self.bias.float()
                return y.to(x.dtype)
            if kernels.usable(x, self.weight):  # 2-16 rows: each weight streamed once for all of them
                return kernels.small_linear(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        if self._packed is not None:
            if self._packed_key != _key(self.weight):
                self.pack()
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self._packed_key = _key(self.weight)


def _key(w: torch.Tensor) -> tuple:
    return w._version, w.data_ptr()


def packable(model: nn.Module) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Give every Linear of a CPU bf16 model its packed weight (see the module docstring); returns the bytes
    the packed copies take (the KV budget, sized later, sees them). A no-op elsewhere."""
    if not packable(model):
        return 0
    total = 0
    for m in model.modules():
        if isinstance(m, Linear):
            m.pack()
            total += m.weight.numel() * m.weight.element_size()
    return total


def unpack_linears(model: nn.Module) -> None:
    """Drop the packed copies: every Linear runs F.linear again (the reference in tests and benchmarks)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m._packed = None


def fast_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for a plain nn.Linear outside autograd, through the bf16 few-row kernel where it serves x (a
    learned drafter's step: one to a few rows, whose unpacked oneDNN products reorder every weight at each
    call, ~8 GB/s); layer(x) everywhere else, and always when gradients are on (training the drafter)."""
    if not torch.is_grad_enabled() and kernels.usable(x, layer.weight):
        return kernels.small_linear(x, layer.weight, layer.bias)
    return layer(x)
