"""The decoder layer in few kernels, with HF's arithmetic: the rotation through a roll and the signed sin table,
the norm's product rounded as it is stored (llama.py), each bit for bit against transformers; and the kernel
counts that `python -m rlspec.bench kernels` reports, held to their budget (each kernel is a CUDA graph node)."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.qwen2 import modeling_qwen2 as hf_qwen2

from rlspec.bench import kernels as bench
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.model.llama import RMSNorm, rope, rope_table

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_hf_rotation_bit_for_bit(dtype):
    """q and k of a fused q|k|v product rotated as one tensor equal transformers' apply_rotary_pos_emb with its
    own RoPE module's tables, in every bit, at positions where the rounding of the products matters."""
    hf_cfg = tf.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6)
    nh, nkv, D = 4, 2, 16
    B, T = 3, 5
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(B, T, nh + 2 * nkv, D, generator=g) * 3).to(dtype)
    pos = torch.randint(0, 4000, (B, T), generator=g)
    cos_t, sin_t = rope_table(ModelConfig.from_hf(hf_cfg), 4000, "cpu")
    q, k = rope(qkv, cos_t[pos].to(dtype)[:, :, None], sin_t[pos].to(dtype)[:, :, None], nh + nkv).split([nh, nkv], 2)

    hf_cos, hf_sin = hf_qwen2.Qwen2RotaryEmbedding(hf_cfg)(qkv, pos)
    hq, hk = hf_qwen2.apply_rotary_pos_emb(qkv[:, :, :nh].transpose(1, 2), qkv[:, :, nh:nh + nkv].transpose(1, 2),
                                           hf_cos, hf_sin)
    assert torch.equal(q.transpose(1, 2), hq) and torch.equal(k.transpose(1, 2), hk)
    assert not torch.equal(q, qkv[:, :, :nh])  # it rotated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad", [False, True])
def test_rmsnorm_is_hf_bit_for_bit(dtype, grad):
    """The norm's float32 product is rounded to the model's dtype as it is stored (one kernel) during inference, and
    by a separate cast where autograd needs it (a drafter's training): both equal transformers' norm exactly."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 7, 96, generator=g) * 5).to(dtype).requires_grad_(grad)
    ours, theirs = RMSNorm(96, 1e-6).to(dtype), hf_qwen2.Qwen2RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        w = (1 + torch.randn(96, generator=g) * 0.3).to(dtype)
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    with torch.set_grad_enabled(grad):
        out = ours(x)
        assert torch.equal(out, theirs(x))
    if grad:
        out.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_decoder_layer_and_drafter_level_keep_their_kernel_budget():
    """A bf16 decode step's layer in 29 kernels (37 before the rotation and norm were fused: each is a graph node
    replayed 28 times a Qwen2.5-7B step), its head in 9, an EAGLE-3 level in 51; by op, so that a change that
    brings back HF's rotate_half (neg and cat) or a norm's separate cast fails here by name."""
    model = bench.target(torch.bfloat16)
    layer, head = bench.layer_counts(model, torch.bfloat16, batch=4, tokens=1)
    ops = layer.counts
    assert ops["linear"] == 4 and ops["attention"] == 1 and ops["index_put_"] == 2  # it counted the layer
    assert ops["roll"] == 1 and ops["neg"] == 0 and ops["cat"] == 0  # q and k rotate once, with no rotate_half
    assert ops["to"] == 2  # the norms' float32 upcast; their downcast is inside the product
    assert layer.total <= 29, dict(ops)
    assert head.total <= 9, dict(head.counts)
    level = bench.eagle3_counts(model, torch.bfloat16, batch=4)
    assert level.counts["roll"] == 2 and level.counts["neg"] == 0
    assert level.total <= 51, dict(level.counts)


def test_the_counter_counts_copies_not_views():
    """What the budget rests on: a view or an allocation is no kernel, a dtype conversion is one, an op is one."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with bench.DeviceOps() as ops:
        y = x.view(8, 4).transpose(0, 1)
        torch.empty_like(y)
        x.to(torch.bfloat16)  # no copy: no kernel
        z = x.float()
        z.mul(2)
    assert dict(ops.counts) == {"to": 1, "mul": 1}
