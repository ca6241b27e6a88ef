"""CPU kernels of our own, built on first use:
  * the bf16 few-row product of compiled steps (small_gemm.cpp), on a weight as a module holds it (`small_linear`)
    or on a blocked copy of it (`pack`, `packed_linear`: the same bits, read as one contiguous stream per block of
    8 rows; what compiled steps use);
  * a step's attention read in place from the paged KV pool (paged_attention.cpp, `paged_attention`), each key
    and value once for all the queries of its KV head (docs/runtime.md#attention-on-the-cpu);
  * each decoder layer of a step as one op (decoder_layer.cpp, model/fused.py);
  * a plain step's draw, logprob and finite check (sample.cpp, `sample_rows`: runtime/sampling.py), and a chain's
    verification with them (verify_chain.cpp, `verify_chain_rows`: speculation/verify.py); these two are also
    built portably, on their own, where the rest cannot be (`draws_available`);
  * a learned drafter's chain after its catch-up: draft steps, head and draws (draft_chain.cpp,
    speculation/drafters/eagle3_fused.py).

Why: a speculative verify at batch 1 multiplies each weight by 2-16 rows. Inside a compiled step inductor lowers
such a product to oneDNN on the unpacked weight, which reorders it on every call (a third of the bandwidth), and
the single-row reduction of model/linear.py reads the weight once per row; so verify steps ran eagerly at about
twice a decode step's time, and speculation had to accept two tokens a step just to break even. The kernel streams
each weight once for all rows (docs/runtime.md#verify-steps-on-the-cpu). Attention through inductor's fused
kernel read the cache at ~5 GB/s and once per query: half of a long rollout's step.

Built once per machine with torch's extension builder (about 20 s; ninja and a C++ compiler) under
$RLSPEC_CACHE/kernels/<source hash>, and loaded from there afterwards (build.py: a killed build never blocks a
later one; a cache directory that other users can write is not loaded from). Only where the CPU has AVX-512 BF16
(`available`); anywhere else the draws alone (`draws_available`: portable flags, ~15 s to build), which take a
chain's verification from ~25 small torch ops to one (on the CPU those ops were half of a chain step's host time:
`python -m rlspec.bench host`). When a build fails (one warning), or with RLSPEC_CPU_KERNELS=0, nothing changes:
steps run as before. The ops are real torch ops (`torch.ops.rlspec_kernels.*`), so inductor calls them from a
compiled step like any extern kernel and fuses everything around them.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(n) for n in ("small_gemm.cpp", "paged_attention.cpp", "decoder_layer.cpp",
                                                 "sample.cpp", "draft_chain.cpp", "verify_chain.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "ops.h")]  # included by the sources: part of the hash
DRAW_SOURCES = [Path(__file__).with_name(n) for n in ("sample.cpp", "verify_chain.cpp")]  # no intrinsics needed
MAX_ROWS = 16  # products of more rows are compute-bound in this kernel; oneDNN's blocked GEMM wins there
ENV = "RLSPEC_CPU_KERNELS"
ready = False  # set by available() once the op is loaded; read inside compiled code, which must not build it
attention = True  # steps attend through paged_attention where it serves them (benchmarks switch it off to compare)


def cpu_has_avx512_bf16() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512_bf16"} <= set(flags.split())


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether torch.ops.rlspec_kernels.small_linear can be called (building it the first time)."""
    if os.environ.get(ENV, "1") == "0" or not cpu_has_avx512_bf16():
        return False
    try:
        _build()
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: keep the previous path
        warnings.warn(f"rlspec: CPU verify kernel unavailable ({type(exc).__name__}: {exc}); verify steps run as "
                      f"before. Set {ENV}=0 to silence this.", stacklevel=2)
        return False
    global ready
    ready = True
    return True


FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


def _draw_flags() -> list[str]:
    """Portable flags, with AVX2 and FMA where this CPU has them (the build is per machine: the cache directory's
    name holds the flags)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return ["-O3", "-fopenmp"] + (["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(flags.split()) else [])


DRAW_FLAGS = _draw_flags()


def source_digest(sources: list[Path] = SOURCES, flags: list[str] = FLAGS) -> str:
    """The build's identity: the sources, headers, flags and torch version (a build directory's name, and part of
    the calibration cache's key: a changed kernel is timed again)."""
    text = b"".join(p.read_bytes() for p in sources + HEADERS) + f"{torch.__version__} {flags}".encode()
    return hashlib.sha256(text).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def draws_available() -> bool:
    """Whether torch.ops.rlspec_kernels.sample_rows and verify_chain_rows can be called: from the full library where
    it is `available`, else from a portable build of those two alone (the same op names: one of the two is ever
    loaded in a process)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    if available():
        return True
    if platform.system() != "Linux":  # the extension builder's toolchain is only relied on here
        return False
    from rlspec.rollout.runtime.model.fetch import cache_root
    from rlspec.rollout.runtime.model.kernels.build import load_library

    digest = source_digest(DRAW_SOURCES, DRAW_FLAGS)
    try:
        load_library(f"rlspec_draws_{digest}", DRAW_SOURCES, DRAW_FLAGS, ["-fopenmp"],
                     cache_root() / "kernels" / digest)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: keep the torch path
        warnings.warn(f"rlspec: CPU sampling kernels unavailable ({type(exc).__name__}: {exc}); steps draw with torch "
                      f"ops as before. Set {ENV}=0 to silence this.", stacklevel=2)
        return False
    return True


def _build() -> None:
    """Build (or find built) and load the op, once per process: a torch library namespace registers once."""
    global _loaded
    if _loaded:
        return
    from rlspec.rollout.runtime.model.fetch import cache_root
    from rlspec.rollout.runtime.model.kernels.build import load_library

    digest = source_digest()
    load_library(f"rlspec_kernels_{digest}", SOURCES, FLAGS, ["-fopenmp"], cache_root() / "kernels" / digest)

    @torch.library.register_fake("rlspec_kernels::small_linear")
    def _(x, w, bias=None):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("rlspec_kernels::packed_linear")
    def _(x, wp, bias, N):
        return x.new_empty(*x.shape[:-1], N)

    @torch.library.register_fake("rlspec_kernels::decoder_layer")
    def _(x, *args):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("rlspec_kernels::final_head")
    def _(x, norm, lm_head, vocab, eps):
        return x.new_empty(*x.shape[:-1], vocab, dtype=torch.float32)

    @torch.library.register_fake("rlspec_kernels::paged_attention")
    def _(q, k_pool, v_pool, blocks, mask, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("rlspec_kernels::sample_rows")
    def _(logits, u, temperature):
        B = logits.shape[0]
        return logits.new_empty(B, dtype=torch.long), logits.new_empty(B, 3, dtype=torch.float64)

    _loaded = True


_loaded = False


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether small_linear serves x @ weight^T: CPU, bf16, at most MAX_ROWS rows, and the kernel loaded (by
    `available`, which the compiled runner calls before compiling anything)."""
    return (ready and x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.shape[:-1].numel() <= MAX_ROWS)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.rlspec_kernels.small_linear(x, weight, bias)


BLOCK_ROWS, BLOCK_K = 8, 32  # small_gemm.cpp's NB and its 32-element step


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] in packed_linear's layout [ceil(N/8), ceil(K/32), 8, 32], zero-padded: each block of 8 rows
    one contiguous stream. out: a tensor of that shape to write into (keeping its identity, which compiled
    steps hold), else a new one."""
    N, K = weight.shape
    nb, kc = -(-N // BLOCK_ROWS), -(-K // BLOCK_K)
    padded = torch.nn.functional.pad(weight.detach(), (0, kc * BLOCK_K - K, 0, nb * BLOCK_ROWS - N))
    blocked = padded.view(nb, BLOCK_ROWS, kc, BLOCK_K).transpose(1, 2)
    if out is None:
        return blocked.contiguous()
    return out.copy_(blocked)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x @ W^T (+ bias) from pack(W): the same bits as small_linear(x, W, bias), read at a contiguous stream's speed."""
    return torch.ops.rlspec_kernels.packed_linear(x, packed, bias, out_features)


def attention_usable(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether paged_attention serves a step's queries q [B, H, T, D] over this KV pool: CPU, bf16, at most
    MAX_ROWS tokens a row, a head size of whole 32-element steps, and the kernel loaded."""
    return (ready and attention and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and pool.dtype == torch.bfloat16 and q.shape[2] <= MAX_ROWS and q.shape[3] % 32 == 0)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, H, T, D] over the rows' cached keys and values, read in place from the layer's pools
    [num_blocks, bs, KV, D] through blocks [B, n]; mask [B, 1, T, n * bs] bool (paged_attention.cpp)."""
    return torch.ops.rlspec_kernels.paged_attention(q, k_pool, v_pool, blocks, mask, scale)
