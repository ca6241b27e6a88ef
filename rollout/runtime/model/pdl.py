"""Programmatic dependent launch (PDL) of our Triton kernels on Hopper and later GPUs: a kernel of a step's CUDA
graph launched while the kernel before it finishes.

Why: between two dependent kernels of a graph the device idles while the second is launched and its programs are
scheduled, about a microsecond each time on an H100, and a 7B decode step at batch 1 runs ~200 of our kernels
(docs/gpu.md#where-a-step-goes). A kernel launched with CUDA's programmatic stream serialization may start once
every program of the kernel before it has signalled (`gdc_launch_dependents`); its `gdc_wait` returns once that
kernel has completed and its writes are visible. Each of our kernels does both first thing (`dependent_start`),
before any memory access, so what it reads and writes is ordered as without PDL (a kernel two back completed before
the one between returned from its own wait): only the launch overlaps.

`serves(x)`: on CUDA devices of compute capability 9 and later, while `enabled` (RLSPEC_PDL=0 turns it off; the
device check times steps both ways), and once a self-test passed on the device: a kernel of ours (`halves`) first,
after a torch kernel, after a copy and after itself, eagerly and replayed from a CUDA graph, equal to the same chain
without PDL. Where the self-test fails (a driver that cannot capture the attribute) it warns once and our kernels launch
without PDL. The self-test never runs inside a capture: until it has, kernels captured go without."""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: our kernels launch without PDL (never compiled: only under PDL's branch)
    gdc_launch_dependents = gdc_wait = None

enabled = os.environ.get("RLSPEC_PDL", "1") != "0"
_passed: dict[int, bool] = {}  # device index -> the self-test passed there (run once per process and device)


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """First thing in each of our kernels: with PDL, wait for the kernel before to complete (its writes visible),
    then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def serves(x: torch.Tensor) -> bool:
    """Whether our kernels launched for x's device take PDL now."""
    if not (enabled and x.is_cuda and gdc_wait is not None):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    passed = _passed.get(index)
    if passed is None:
        if torch.cuda.get_device_capability(index) < (9, 0):
            passed = False
        elif torch.cuda.is_current_stream_capturing():
            return False  # no self-test inside a capture: this one goes without
        else:
            passed = _self_test(torch.device("cuda", index))
        _passed[index] = passed
    return passed


@triton.jit
def _halves(X, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Y = X / 2 (exact): the self-test's kernel."""
    dependent_start(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < n) * 0.5, mask=i < n)


def launch(dependent: bool) -> dict:
    """One of our kernels' launch arguments for PDL: its PDL constant (`dependent_start`) and, where `dependent`,
    CUDA's programmatic serialization (no option otherwise, which a Triton without it also takes)."""
    return {"PDL": True, "launch_pdl": True} if dependent else {"PDL": False}


def halves(x: torch.Tensor, dependent: bool) -> torch.Tensor:
    """x / 2 by `_halves`, launched dependent on the kernel before where `dependent`."""
    y = torch.empty_like(x)
    _halves[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, **launch(dependent))
    return y


def status() -> dict[int, bool]:
    """Per device index, whether our kernels launch with PDL there (what the device check reports)."""
    return {index: passed and enabled for index, passed in _passed.items()}


def _self_test(device: torch.device) -> bool:
    a = torch.randn(4, 4096, device=device)
    buf = torch.empty_like(a)

    def chain(dependent: bool) -> torch.Tensor:
        x = halves(a, dependent) + 1  # ours first (a graph's first node), then torch's
        buf.copy_(halves(x, dependent))  # ours after a torch kernel; a copy (a graph's memcpy node) after ours
        return halves(halves(buf, dependent), dependent) - 1  # ours after the copy and after ours; torch's after

    try:
        eager_ok = torch.equal(chain(True), chain(False))
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a drafter's trainer) is not the capture's
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = chain(True)
        a.copy_(torch.randn_like(a))
        graph.replay()
        ok = eager_ok and torch.equal(out, chain(False))
    except Exception as exc:  # noqa: BLE001 - a driver that cannot launch or capture it: our kernels go without
        warnings.warn(f"programmatic dependent launch failed its self-test on {device} ({type(exc).__name__}: "
                      f"{exc}); our Triton kernels launch without it", RuntimeWarning, stacklevel=3)
        return False
    if not ok:
        warnings.warn(f"programmatic dependent launch gave other results than without it on {device}; our Triton "
                      "kernels launch without it", RuntimeWarning, stacklevel=3)
    return ok
