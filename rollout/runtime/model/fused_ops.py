"""Where our Triton kernels (rope_write.py, silu_mul.py, few_rows.py) replace torch's ops in a CUDA step, and the
torch ops they replace (the reference on every other device, and each kernel's fallback).

`triton_serves` says where a kernel serves: CUDA, 16 bits, outside autograd (a drafter's training) and compiled
code (a compiled layer's Inductor fuses the same ops itself), with Triton installed and the kernel not failed in
this process. A product of a few rows (`product`, `normed_product`, `gated_product`) takes our kernel only where it was
also measured faster than torch's ops on this device, for its shape. A kernel that fails there (a Triton that cannot
compile it) warns once, its step gets the reference's result, and the torch ops serve from then on
(attention.with_fallback). Each kernel's bits and its fallback are tested on any machine through Triton's
interpreter (tests/rollout/runtime/test_rope_write.py, test_silu_mul.py, test_few_rows.py); why each exists is
docs/gpu.md#where-a-step-goes."""
from __future__ import annotations

import functools
import importlib
import warnings

import torch
import torch.nn.functional as F

from rlspec.rollout.runtime.kv_cache import write_slots
from rlspec.rollout.runtime.model.attention import triton_available, with_fallback
from rlspec.rollout.runtime.model.rotary import rope


def rotate_and_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, nh: int, nkv: int) -> torch.Tensor:
    """A step's q and k heads of the fused q|k|v product rotated together (`rope`), k and v written to the pools at
    their slots -> q [B, T, nh, hd]. The torch ops: six kernels, one where `step_rotation` picks the fused one."""
    q, k = rope(qkv, cos, sin, nh + nkv).split([nh, nkv], 2)
    write_slots(k_cache, slots, k)
    write_slots(v_cache, slots, qkv[:, :, nh + nkv:])
    return q


def step_rotation(qkv: torch.Tensor):
    """The function that does a step's `rotate_and_write`: where `triton_serves`, one Triton kernel (rope_write.py)
    where the torch ops take six (a roll, two products, a sum, two scatters), each a node of every CUDA graph,
    computing the same bits; elsewhere the torch ops."""
    return _fused_rotation if triton_serves(qkv, _rotation_error) else rotate_and_write


def rotate_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, T, nh, hd] and k [B, T, nkv, hd] of separate products (a learned drafter's layer) rotated (`rope`):
    one Triton kernel where `triton_serves` (rope_write.py, the same bits), else torch's eight."""
    if triton_serves(q, _pair_error):
        return _fused_pair(q, k, cos, sin)
    return rope_pair(q, k, cos, sin)


def rope_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return rope(q, cos, sin), rope(k, cos, sin)


def gated(act, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """act(gate) * up of the fused gate|up product [..., 2 inter]: the torch ops (two kernels)."""
    gate, up = gate_up.split(inter, -1)
    return act(gate) * up


def silu_times(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    return gated(F.silu, gate_up, inter)


def triton_serves(x: torch.Tensor, errors: list[str]) -> bool:
    """Whether one of our Triton kernels does x's op (rope_write.py, silu_mul.py): on CUDA in 16 bits, outside
    autograd and compiled code (a compiled layer's Inductor fuses the same ops itself), with Triton installed, and
    the kernel not failed in this process (`errors`)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and not errors and triton_available())


@functools.cache
def _kernel(module: str, name: str):
    """A kernel's function from one of our Triton modules, imported on first use (they import triton)."""
    return getattr(importlib.import_module(f"rlspec.rollout.runtime.model.{module}"), name)


def _triton(module: str, name: str):
    return lambda *args, **launch: _kernel(module, name)(*args, **launch)


_rotation_error: list[str] = []  # each fused kernel's first failure in this process
_silu_error: list[str] = []
_pair_error: list[str] = []
_fused_rotation = with_fallback(_triton("rope_write", "rotate_and_write"), rotate_and_write, _rotation_error,
                                "the Triton rotation kernel", "steps rotate with torch's ops from now on")
_fused_pair = with_fallback(_triton("rope_write", "rotate_pair"), rope_pair, _pair_error, "the Triton rotation kernel",
                            "drafter layers rotate with torch's ops from now on")
_fused_silu_mul = with_fallback(_triton("silu_mul", "silu_mul"), silu_times, _silu_error, "the Triton SiLU kernel",
                                "MLPs take torch's ops from now on")


def activation_product(act, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """act(gate) * up of an MLP's fused gate|up product [..., 2 inter]: SiLU's as one Triton kernel where
    `triton_serves` (silu_mul.py), else the torch ops."""
    if act is F.silu and triton_serves(gate_up, _silu_error):
        return _fused_silu_mul(gate_up, inter)
    return gated(act, gate_up, inter)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """(residual +) x W^T (+ bias), the product of a Linear (and, with `residual`, the layer's residual sum added
    as it is stored, llama.plus_product): few_rows.py's kernel where it serves and was measured faster than
    torch's product (`_ours_where_faster`), else torch's (`torch_product`)."""
    args = (x, weight, bias, residual)
    return _ours_where_faster(("product", bias is not None, residual is not None), args, (torch_product, *args))


def normed_product(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
                   bias: torch.Tensor | None, unfused) -> torch.Tensor:
    """rms_norm(x, norm, eps) W^T (+ bias): the norm before a layer's product (llama.normed) taken inside
    few_rows.py's kernel, one kernel where the norm and the product take two, where it serves and was measured
    faster than `unfused()` (the norm's module, then the product's); else unfused()."""
    return _ours_where_faster(("normed", bias is not None), (x, weight, bias, None, norm, eps), (unfused,))


def gated_product(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, unfused) -> torch.Tensor:
    """residual + (silu(gate) * up) W^T of an MLP's fused gate|up product: SiLU times up computed inside few_rows.py's
    product as it loads its x, one kernel where SiLU's (`activation_product`) and the product take two, where it
    serves and was measured faster than `unfused()` (the two apart); else unfused()."""
    return _ours_where_faster(("gated",), (gate_up, weight, None, residual, None, 0.0, True), (unfused,))


def _ours_where_faster(kind: tuple, args: tuple, theirs: tuple) -> torch.Tensor:
    """_fused_product(*args) (args: x, weight, then few_rows.product's others) where our kernel serves x (`_few`)
    and was measured faster than theirs, (fn, *its args), for this kind (its name, then its flags), weight shape
    and row bucket (`_faster_here`); else theirs."""
    x, weight = args[:2]
    if _few(x, _product_error):
        key = (kind[0], tuple(weight.shape), _bucket(x), *kind[1:], x.dtype, x.device)
        if _faster_here(key, (_fused_product, *args), theirs):
            return _fused_product(*args, **_launch.get(key, {}))
    return theirs[0](*theirs[1:])


def torch_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, norm: torch.Tensor | None = None,
                  eps: float = 0.0, gated: bool = False) -> torch.Tensor:
    """torch's ops for `product`: F.linear; with a residual and no bias one addmm, which adds it as it stores;
    with `norm`, torch's fused rms_norm first; gated, SiLU times up of x first (the kernel's fallback)."""
    if gated:
        x = silu_times(x, x.shape[-1] // 2)
    if norm is not None:
        x = F.rms_norm(x, norm.shape, norm, eps)
    if residual is None:
        return F.linear(x, weight, bias)
    if bias is None:
        H = residual.shape[-1]
        return torch.addmm(residual.reshape(-1, H), x.reshape(-1, x.shape[-1]), weight.t()).view(residual.shape)
    return residual + F.linear(x, weight, bias)


FEW_ROWS = 64  # few_rows.MAX_ROWS (not imported: that module imports triton)
# our kernel's pipeline depths timed for each shape, few_rows.STAGES first: W's next tile or next two in flight. The
# same bits at each (the same tiles summed in the same order); what keeps the memory busy on a device (a product of
# 224 programs on 132 SMs) is measured there, not guessed
DEPTHS = (3, 4)
_product_error: list[str] = []
_fused_product = with_fallback(_triton("few_rows", "product"), torch_product, _product_error,
                               "the Triton product kernel", "products take torch's ops from now on")
_faster: dict[tuple, bool] = {}  # (kind, weight shape, row bucket, ..., dtype, device) -> our kernel is faster
# ours serves only where measured this much faster: a tie keeps torch's. On the H200 (2026-12-04) a normed gate|up
# product at one row timed 161.6 us by ours against 161.9 by torch's two ops, and ours served in one process and not
# in another: 2.3 ms a 7B step apart, from a coin flip
MARGIN = 0.03
_launch: dict[tuple, dict] = {}  # the same keys -> our kernel's launch options where the fastest is not its default
timings: dict[tuple, tuple[float, float]] = {}  # the same keys -> (our seconds at the fastest depth, torch's)


def _few(x: torch.Tensor, errors: list[str]) -> bool:
    """A product of 1-FEW_ROWS rows of x where our kernel can serve and its time be measured (CUDA events)."""
    return 0 < x.numel() // max(x.shape[-1], 1) <= FEW_ROWS and _timed_here(x) and triton_serves(x, errors)


def _timed_here(x: torch.Tensor) -> bool:
    """Whether the choice between the kernels can be timed where x lives (CUDA events)."""
    return x.is_cuda


def _bucket(x: torch.Tensor) -> int:
    """x's rows rounded up to a power of two: 1, 2, 4, 8, 16, 32, 64."""
    return 1 << (x.numel() // x.shape[-1] - 1).bit_length()


def _faster_here(key: tuple, ours: tuple, theirs: tuple) -> bool:
    """Whether ours (fn, *args) ran faster than theirs on this device, measured once per key on the call's own
    inputs, each with its weight out of the cache (`_seconds`), and kept for the process; ours at each of DEPTHS,
    the fastest kept (`_launch`). Nothing is timed inside a CUDA graph's capture, which then takes theirs (a graph's
    warm-up runs, before its capture, meet the same shapes and decide)."""
    faster = _faster.get(key)
    if faster is None:
        if ours[1].is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        try:
            depth, seconds = _fastest_depth(ours)
            if depth != DEPTHS[0]:
                _launch[key] = dict(stages=depth)
            timings[key] = (seconds, _seconds(*theirs))
        except Exception as exc:  # a device that cannot time them: torch's, which serves everywhere
            warnings.warn(f"timing our few-rows product against torch's failed ({type(exc).__name__}: {exc}); "
                          "torch's product serves this shape", RuntimeWarning, stacklevel=2)
            timings[key] = (float("nan"), float("nan"))
        faster = _faster[key] = bool(timings[key][0] < timings[key][1] * (1 - MARGIN)) and not _product_error
    return faster


def _fastest_depth(ours: tuple) -> tuple[int, float]:
    """(depth, seconds) of ours (fn, *args) at the fastest of DEPTHS: the kernel's default first (where it fails, it
    fails for good); a deeper one that fails (more shared memory than the device has) is left out; a tie keeps the
    first."""
    depths = {DEPTHS[0]: _seconds(*ours)}
    for d in DEPTHS[1:]:
        try:
            depths[d] = _seconds(*ours, stages=d)
        except Exception:  # noqa: BLE001 - a depth this device cannot hold: the others
            pass
    depth = min(depths, key=depths.get)
    return depth, depths[depth]


def forget_choices() -> None:
    """Forget what `_faster_here` measured (tests that time with stand-ins)."""
    for measured in (_faster, _launch, timings):
        measured.clear()


def product_choices() -> list[dict]:
    """What `_faster_here` measured in this process: per kind (a product, a normed or a gated one), weight shape and
    row bucket, microseconds by our kernel (at its fastest depth, `stages`) and by torch's, and which serves (the
    device check reports them)."""
    return [dict(kind=k[0], weight=list(k[1]), rows=k[2], ours_us=round(t[0] * 1e6, 2),
                 torch_us=round(t[1] * 1e6, 2), ours=_faster[k], stages=_launch.get(k, {}).get("stages", DEPTHS[0]))
            for k, t in timings.items()]


TIMED = 15  # timed runs of each candidate (the median)
SPIN_CYCLES = 100_000  # torch.cuda._sleep before a timed run: ~50 us of the device's for the host to launch it


def _seconds(fn, *args, **launch) -> float:
    """Device seconds of one fn(*args, **launch) as a step meets it: its weight out of the L2 cache (a step streams
    every other weight between two reads of this one, where runs back to back would read a weight of under ~50 MB,
    a layer's q|k|v or o, from the cache) and no launch cost of the host's in it (for a product of a few
    microseconds it would decide the comparison). Each timed run follows a read of a buffer twice the cache's size
    (clean lines: a write would leave the run the cache's write-backs) and a spin that keeps the device busy while
    the host launches the run; CUDA events around the run alone; the median of TIMED, after one run outside them (a
    kernel's compile). The run is a replay of fn captured in a CUDA graph, as a step runs it (`_graphed`): one
    launch, whatever fn launches and however slow its launchers (Triton's, a Python function's two ops), which the
    spin covers; where fn cannot be captured, it is launched as it is."""
    fn(*args, **launch)
    run = _graphed(fn, args, launch) or (lambda: fn(*args, **launch))
    device = torch.cuda.current_device()
    # read to evict the cache (its values are never used); freed when the timing ends, for the allocator to reuse
    flush = torch.empty(torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.float16, device=device)
    times = []
    for _ in range(TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.max()
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        run()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    seconds = sorted(start.elapsed_time(end) / 1e3 for start, end in times)
    return seconds[len(seconds) // 2]


def _graphed(fn, args: tuple, launch: dict):
    """fn(*args, **launch) captured in a CUDA graph (on a side stream, as graphs._CudaGraph captures the engine's
    steps: no synchronisation or cache emptying; not that class itself, which sits above this module), its replay;
    None inside another capture or where fn cannot be captured."""
    if torch.cuda.is_current_stream_capturing():
        return None
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                fn(*args, **launch)
            finally:
                graph.capture_end()
    except Exception:  # noqa: BLE001 - an op that refuses capture: timed as launched
        return None
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay
