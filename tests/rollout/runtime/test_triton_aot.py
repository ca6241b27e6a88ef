"""Our Triton kernels compile for a Hopper GPU (sm_90: the H100/H200) on any machine, through Triton's own ptxas
(triton_aot.py, in a process with the interpreter off), with no register spilled: the GPU compiler's refusals
and a variant too large for its warps surface here, before a GPU runs them. The paged attention and the few-rows
product compile as a launch specialises them (pointers and strides divisible by 16), so with the pipelined,
vectorised loads the GPU runs and the registers those take, and with their loads a tile ahead.

Twice: with the Triton installed here, and with the one the GPU machine's torch brings (2.11: Triton 3.6), which
compiles our kernels there. A construct newer than its Triton would fail that machine's first launch of it, in a
device run of a few minutes; here it fails in seconds."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="needs triton")

GPU_CHECK_TRITON = "3.6.0"  # the Triton of the GPU machine's torch 2.11 (docs/gpu.md#the-device-check-make-gpu-check)


@pytest.mark.parametrize("version", ["installed", GPU_CHECK_TRITON])
def test_every_kernel_variant_compiles_for_sm90(version):
    with tempfile.TemporaryDirectory() as other:  # that Triton's ~650 MB, gone after the test
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
        where = Path(triton.__file__).parent
        if version not in ("installed", triton.__version__):
            pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", other,
                                  f"triton=={version}"], capture_output=True, text=True, timeout=300)
            if pip.returncode:
                pytest.skip(f"triton {version} cannot be installed here: {pip.stderr[-300:]}")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [other, env.get("PYTHONPATH")]))
            where = Path(other) / "triton"
        if not (where / "backends" / "nvidia" / "bin" / "ptxas").is_file():
            pytest.skip("this Triton ships no ptxas")
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_aot.py")), "90"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert any(line.endswith(f"from {where}") for line in out.stderr.splitlines()), out.stderr[:300]  # that Triton
    lines = out.stdout.splitlines()
    compiled = [line.split()[0] for line in lines]
    assert compiled.count("_split") == 5 and compiled.count("_combine") == compiled.count("_halves") == 1 and compiled.count("_rope_write") == 2
    assert compiled.count("_silu_mul") == 2 and compiled.count("_rope_pair") == 2 and compiled.count("_few_rows") == 14
    assert compiled.count("_chunk_stats") == compiled.count("_draw") == 1
    assert all(line.endswith("STACK:0") for line in lines), lines  # no register spills
    assert all(", pdl," in line for line in lines), lines  # each waits for the kernel before, as launched on sm_90
    streaming = [line for line in lines if line.startswith(("_split", "_few_rows"))]  # the kernels bandwidth bounds
    assert all(", cp.async," in line for line in streaming), streaming  # their loads pipelined
    # ... a tile ahead: two buffers or more, a tile's copies in flight while the one before is computed on (the paged
    # kernel reading its block table inside each tile's iteration got one, and waited for every copy each tile)
    assert all(int(line.split(" buffers,")[0].rsplit(" ", 1)[1]) >= 2 for line in streaming), streaming
    # ... and on sm_90 the products at their default depth (two buffers) leave room for two programs an SM (228 KB,
    # 1 KB of it reserved a program): one an SM halves what keeps the memory busy (a normed gate|up of 114 KB timed
    # 2.3x the plain product on the H200)
    products = [line for line in lines if line.startswith("_few_rows 90 ") and " 2 buffers," in line]
    assert products and all(int(re.search(r": (\d+) B shared", line)[1]) <= 113 * 1024 for line in products), products
