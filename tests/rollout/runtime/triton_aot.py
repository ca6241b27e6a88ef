"""Compile our Triton kernels for NVIDIA GPUs without one (Triton's own ptxas, no device): the variants the engine
launches, for Ampere (sm_80) and Hopper (sm_90), or the architectures given (`python triton_aot.py 90`). What the interpreter cannot catch (a construct the GPU compiler
refuses, a type it cannot lower) fails here. Run by test_triton_aot.py in a process of its own (TRITON_INTERPRET
must be off when triton is imported); prints one line per kernel compiled, with its registers and spills (STACK) per thread."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") in ("0", ""), "the interpreter must be off"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rlspec.rollout.runtime.model import (few_rows, fused_ops, paged_decode, pdl, rope_write,  # noqa: E402
                                         sample_rows, silu_mul)


def compile_one(fn, pointers: dict, constexprs: dict, target, floats=(), num_warps: int = 4, aligned=(),
                num_stages: int = 3) -> None:
    """aligned: arguments a launch finds divisible by 16 (the pointers and sizes of the shapes the engine runs), as
    Triton's launcher specialises them: what lets it vectorise and pipeline the loads (cp.async). Prints the
    buffers of the pipelined loads too: 2 or more, a tile's loads in flight while the one before is computed on.
    Each compiles as the engine launches it on the target: on sm_90 and later with programmatic dependent launch
    (pdl.py; "pdl" printed where its wait is in the code), before without."""
    constexprs = {**constexprs, "PDL": target.arch >= 90}
    signature = {n: pointers.get(n, "fp32" if n in floats else "constexpr" if n in constexprs else "i32")
                 for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages,
                                                             launch_pdl=constexprs["PDL"]))
    loads = "cp.async" if "cp.async" in kernel.asm["ptx"] else "no cp.async"  # loads pipelined through shared memory
    if "griddepcontrol.wait" in kernel.asm["ptx"]:
        loads += ", pdl"
    # the pipeline's buffers: the leading size of the shared buffers its copies fill (none: 0)
    buffers = max(map(int, re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", kernel.asm["ttgir"])), default=0)
    print(f"{fn.__name__} {target.arch} {constexprs}: {kernel.metadata.shared} B shared, {loads}, {buffers} buffers, "
          f"{usage(kernel)}", flush=True)


def usage(kernel) -> str:
    """The cubin's registers and stack (spills) per thread, as cuobjdump (shipped with Triton) reads them."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True)
    return next((line.strip().split(" SHARED")[0] for line in out.stdout.splitlines() if "REG:" in line), "?")


def main(archs: list[int]) -> None:
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        # (dtype, tree, T, direct, query heads per KV head, head size): Qwen2.5-7B's decode, tree verify and a
        # float32 chain; SmolLM2's and Gemma 3's heads
        for dtype, tree, T, direct, G, D in (("bf16", False, 1, False, 7, 128), ("bf16", True, 5, True, 7, 128),
                                             ("fp32", True, 3, False, 7, 128), ("bf16", False, 1, False, 3, 64),
                                             ("bf16", True, 4, False, 2, 256)):
            f32 = dtype == "fp32"
            M = max(16, min(triton.next_power_of_2(G * T), paged_decode.MAX_ROWS))
            pointers = dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}", Table="*i64", Start="*i64",
                            Tree="*u8" if tree else "*i64", Out=f"*{dtype}" if direct else "*fp32", Lse="*fp32")
            # the queries', pools' and partial outputs' strides are multiples of the head size (of 16) at a launch
            strides = [n for n in paged_decode._split.arg_names if n[:3] in ("sq_", "sk_", "sv_", "so_")]
            compile_one(paged_decode._split, pointers,
                        dict(T=T, G=G, D=D, DP=D, BS=128, N=paged_decode.tile_keys(M, D, 4 if f32 else 2, 128), M=M,
                             QT=-(-G * T // M), TREE=tree, DIRECT=direct, F32=f32), target, floats=("scale",),
                        num_warps=paged_decode.warps(M, D), aligned=[*pointers, *strides],
                        num_stages=paged_decode.STAGES)
        compile_one(paged_decode._combine, dict(Part="*fp32", Lse="*fp32", Out="*bf16"),
                    dict(H=28, D=128, DP=128, NSP=64), target)
        compile_one(pdl._halves, dict(X="*fp32", Y="*fp32"), dict(BLOCK=1024), target)  # PDL's self-test
        for dtype in ("bf16", "fp16"):
            pointers = dict(QKV=f"*{dtype}", Cos=f"*{dtype}", Sin=f"*{dtype}", Slots="*i64", Kp=f"*{dtype}",
                            Vp=f"*{dtype}", Q=f"*{dtype}")
            compile_one(rope_write._rope_write, pointers, dict(NH=28, NKV=4, D=128, DP=128, BF16=dtype == "bf16"),
                        target)
            compile_one(rope_write._rope_pair, dict(Q=f"*{dtype}", K=f"*{dtype}", Cos=f"*{dtype}", Sin=f"*{dtype}",
                                                    QO=f"*{dtype}", KO=f"*{dtype}"),
                        dict(NH=28, D=128, DP=128, BF16=dtype == "bf16"), target)
            compile_one(silu_mul._silu_mul, dict(GU=f"*{dtype}", Out=f"*{dtype}"),
                        dict(BF16=dtype == "bf16", BLOCK=silu_mul.BLOCK), target)
        # a plain step's draw (sampling.sample_plain on CUDA): its chunks' statistics, then a row's token
        compile_one(sample_rows._chunk_stats, dict(X="*fp32", Stats="*fp32"), dict(BLOCK=sample_rows.BLOCK), target,
                    floats=("temperature",), num_warps=8, aligned=["X", "s_x"])
        compile_one(sample_rows._draw, dict(X="*fp32", Stats="*fp32", R="*fp32", Tok="*i64", Row="*fp64"),
                    dict(SP=128, BLOCK=sample_rows.BLOCK), target, floats=("temperature",), num_warps=8,
                    aligned=["X", "s_x"])
        # Qwen2.5-7B's products at a decode step: q|k|v (bias), o and down (the residual), gate|up (the LM head's
        # variant), then q|k|v and gate|up with their norms inside, and down with SiLU times up inside
        for N, K, bias, res, norm, gated in ((4608, 3584, True, False, False, False),
                                             (3584, 3584, False, True, False, False),
                                             (37888, 3584, False, False, False, False),
                                             (3584, 18944, False, True, False, False),
                                             (4608, 3584, True, False, True, False),
                                             (37888, 3584, False, False, True, False),
                                             (3584, 18944, False, True, False, True)):
            BN, BK = few_rows.tiles(N, K, gated, norm)
            pointers = dict(X="*bf16", W="*bf16", Bias="*bf16", Res="*bf16", Norm="*bf16", Y="*bf16")
            for stages in fused_ops.DEPTHS:  # each pipeline depth the engine times
                compile_one(few_rows._few_rows, pointers,
                            dict(HAS_BIAS=bias, HAS_RES=res, HAS_NORM=norm, GATED=gated, BM=few_rows.TILE_ROWS,
                                 BN=BN, BK=BK, BF16=True, F32=False), target, floats=("eps",),
                            aligned=[*pointers, "N", "K", "s_xm", "s_wn", "s_rm", "s_ym"], num_stages=stages)


if __name__ == "__main__":
    print(f"triton {triton.__version__} from {Path(triton.__file__).parent}", file=sys.stderr)
    main([int(a) for a in sys.argv[1:]] or [80, 90])
