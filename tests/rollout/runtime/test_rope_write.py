"""The rotation and KV writes of a step as one Triton kernel (model/rope_write.py), against the torch ops it
replaces (fused_ops.rotate_and_write: HF's rotation, bit for bit, and two scatters): every bit of q, of the pools
(slots shuffled, the rest untouched) in bf16 and fp16, a head size that is not a power of two, a NaN kept NaN;
and a model's step through it equals the unfused step. On CUDA compiled; elsewhere through Triton's interpreter
(TRITON_INTERPRET, tests/conftest.py)."""
from __future__ import annotations

import os

import pytest
import torch

from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.model import fused_ops
from rlspec.rollout.runtime.model.fused_ops import rotate_and_write
from rlspec.rollout.runtime.model.rotary import rope_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before triton is imported)", allow_module_level=True)
rope_write = pytest.importorskip("rlspec.rollout.runtime.model.rope_write", reason="needs triton")


def _step(dtype, nh, nkv, D, B=3, T=2, seed=0):
    import transformers as tf

    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig.from_hf(tf.Qwen2Config(hidden_size=nh * D, num_attention_heads=nh, num_key_value_heads=nkv,
                                             head_dim=D, rope_theta=1e6))
    qkv = (torch.randn(B, T, nh + 2 * nkv, D, generator=g) * 3).to(dtype)
    pos = torch.randint(0, 4000, (B, T), generator=g)
    cos_t, sin_t = rope_table(cfg, 4000, "cpu")
    cos, sin = cos_t[pos].to(dtype)[:, :, None], sin_t[pos].to(dtype)[:, :, None]
    blocks = -(-(B * T + 4) // 4)  # blocks of 4 slots, a few left unwritten
    pools = torch.randn(2, blocks, 4, nkv, D, generator=g).to(dtype)
    slots = torch.randperm(blocks * 4, generator=g)[: B * T].view(B, T)
    return [x.to(DEVICE) for x in (qkv, cos, sin, pools[0], pools[1], slots)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nh,nkv,D", [(7, 1, 64), (4, 2, 80)])
def test_one_kernel_is_the_torch_ops_bit_for_bit(dtype, nh, nkv, D):
    qkv, cos, sin, k_pool, v_pool, slots = _step(dtype, nh, nkv, D)
    qkv[0, 0, 0, 3] = float("nan")  # a NaN stays NaN through the rounding
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    q_ref = rotate_and_write(qkv, cos, sin, k_ref, v_ref, slots, nh, nkv)
    q = rope_write.rotate_and_write(qkv, cos, sin, k_pool, v_pool, slots, nh, nkv)
    assert q.shape == q_ref.shape and torch.isnan(q[0, 0, 0]).any()
    assert torch.equal(q.nan_to_num(), q_ref.nan_to_num()) and torch.equal(q.isnan(), q_ref.isnan())
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    assert not torch.equal(q, qkv[:, :, :nh])  # it rotated


@pytest.mark.parametrize("shape", ["decode", "tree"])
def test_a_model_step_through_the_kernel_is_the_unfused_step(monkeypatch, shape):
    """A bf16 step of a tiny model with step_rotation choosing the kernel (as on CUDA) gives the unfused
    step's logits and cache, every bit."""
    from rlspec.rollout.runtime.graphs import EagerRunner
    from rlspec.rollout.runtime.model import llama
    from tests.rollout.runtime.test_graphs import _runner, _tokens, _tree

    runner, lens = _runner(dtype=torch.bfloat16, compile_mode="off")
    T = 1 if shape == "decode" else 4
    depths, tree = _tree(5) if T > 1 else (None, None)
    tokens = _tokens(5, T, seed=2)
    cache, step = runner.cache, EagerRunner(runner.model, runner.cache, "cpu")
    with torch.inference_mode():
        k0, v0 = cache.k.clone(), cache.v.clone()
        ref, _ = step.run(tokens, lens, depths, tree)
        k_ref, v_ref = cache.k.clone(), cache.v.clone()
        cache.k.copy_(k0)  # as before the step: the fused one must write the step's keys and values itself
        cache.v.copy_(v0)
        calls = []

        def fused(*args):
            calls.append(1)
            return rope_write.rotate_and_write(*args)

        monkeypatch.setattr(llama, "step_rotation", lambda qkv: fused)
        got, _ = step.run(tokens, lens, depths, tree)
    assert len(calls) == runner.model.cfg.num_layers and not torch.equal(k_ref, k0)
    assert torch.equal(got, ref) and torch.equal(cache.k, k_ref) and torch.equal(cache.v, v_ref)


def test_a_failing_kernel_warns_once_and_the_torch_ops_serve_from_then_on(monkeypatch, request):
    """A Triton that cannot compile the kernel: the step that met it rotates with the torch ops (the same bits),
    and CUDA steps choose the torch ops from then on (fused_ops.step_rotation reads the recorded failure)."""
    def fail(*args):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(fused_ops, "_kernel", lambda module, name: fail)
    assert not fused_ops._rotation_error
    request.addfinalizer(fused_ops._rotation_error.clear)  # the process's record, empty again for the tests after
    qkv, cos, sin, k_pool, v_pool, slots = _step(torch.bfloat16, 4, 2, 32)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    q_ref = rotate_and_write(qkv, cos, sin, k_ref, v_ref, slots, 4, 2)
    with pytest.warns(RuntimeWarning, match="the Triton rotation kernel failed .*steps rotate with torch's ops"):
        q = fused_ops._fused_rotation(qkv, cos, sin, k_pool, v_pool, slots, 4, 2)
    assert torch.equal(q, q_ref) and torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    assert fused_ops._rotation_error and "no kernel here" in fused_ops._rotation_error[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_drafters_q_and_k_rotate_in_one_kernel_bit_for_bit(dtype):
    """A learned drafter's layer, whose q and k come from separate products: both rotated by one kernel, every bit
    of rotary.rope's on each (a head size that is not a power of two too)."""

    for nh, nkv, D in ((7, 1, 64), (4, 2, 80)):
        qkv, cos, sin, *_ = _step(dtype, nh, nkv, D)
        q, k = qkv[:, :, :nh].contiguous(), qkv[:, :, nh:nh + nkv].contiguous()
        got, ref = rope_write.rotate_pair(q, k, cos, sin), fused_ops.rope_pair(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)) and not torch.equal(got[1], k)
