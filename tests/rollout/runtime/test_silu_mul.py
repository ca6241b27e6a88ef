"""silu(gate) * up as one Triton kernel (model/silu_mul.py) against torch's two ops (fused_ops.silu_times), in bf16
and fp16, on widths that are and are not a multiple of its block: each result rounded as torch rounds it, so
where the exponentials differ the activation differs in its last bit and the product by two at most; a NaN kept
NaN; and an MLP takes it where fused_ops.triton_serves says so (CUDA), with a fallback that warns. On CUDA compiled; elsewhere through Triton's
interpreter (TRITON_INTERPRET, tests/conftest.py)."""
from __future__ import annotations

import os

import pytest
import torch

from rlspec.rollout.runtime.model import fused_ops, llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before triton is imported)", allow_module_level=True)
silu_mul = pytest.importorskip("rlspec.rollout.runtime.model.silu_mul", reason="needs triton")


def _gate_up(dtype, rows=6, inter=1500, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 1, 2 * inter, generator=g) * 4).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [1500, 2048])
def test_one_kernel_is_torchs_two_to_a_last_bit(dtype, inter):
    gate_up = _gate_up(dtype, inter=inter)
    gate_up[0, 0, 5] = float("nan")
    got, ref = silu_mul.silu_mul(gate_up, inter), fused_ops.silu_times(gate_up, inter)
    assert got.shape == ref.shape == (6, 1, inter) and got.dtype == dtype
    assert torch.isnan(got[0, 0, 5]) and torch.equal(got.isnan(), ref.isnan())
    got, ref = got.nan_to_num().float(), ref.nan_to_num().float()
    # the spacing of dtype's numbers at each result: an activation a last bit apart moves the product by up to
    # |up| times its spacing, two of the product's at most
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(torch.finfo(dtype).tiny))))
    assert ((got - ref).abs() <= 2 * ulp).all()
    assert (got == ref).float().mean() > 0.99  # and almost everywhere the same bits


def test_an_mlp_takes_it_where_triton_serves_and_a_failure_falls_back(monkeypatch, request):
    """An MLP whose `triton_serves` answers yes (as on CUDA) computes silu(gate) * up through the kernel; a kernel
    that fails warns once and the MLP's output is torch's."""
    import transformers as tf

    from rlspec.rollout.runtime.model.config import ModelConfig

    cfg = ModelConfig.from_hf(tf.LlamaConfig(hidden_size=64, intermediate_size=1500, num_attention_heads=4))
    mlp = llama.MLP(cfg).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        ref = mlp.down_proj(fused_ops.silu_times(mlp.gate_up_proj(x), 1500))
        monkeypatch.setattr(fused_ops, "triton_serves", lambda t, errors: not errors)
        calls = []

        def counted(*args):
            calls.append(1)
            return silu_mul.silu_mul(*args)

        monkeypatch.setattr(fused_ops, "_kernel", lambda module, name: counted)
        torch.testing.assert_close(mlp(x), ref, atol=0.05, rtol=0.02)
        assert calls == [1]

        def broken(*args):
            raise RuntimeError("no kernel here")

        monkeypatch.setattr(fused_ops, "_kernel", lambda module, name: broken)
        request.addfinalizer(fused_ops._silu_error.clear)  # the process's record, empty again for the tests after
        with pytest.warns(RuntimeWarning, match="the Triton SiLU kernel failed"):
            assert torch.equal(mlp(x), ref)
        assert fused_ops._silu_error and torch.equal(mlp(x), ref)  # torch's ops from then on
