"""The decoder layer in few kernels: the rotation through a roll and the signed sin table and, off CUDA, the norm's
product rounded as it is stored (llama.py), each bit for bit against transformers; on CUDA torch's fused norm
(llama.fused_norm, whose numerics the CUDA tests hold); and the kernel counts that `python -m rlspec.bench kernels`
reports, held to their budget (each kernel is a CUDA graph node)."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.qwen2 import modeling_qwen2 as hf_qwen2

from rlspec.bench import kernels as bench
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.model.llama import RMSNorm
from rlspec.rollout.runtime.model.rotary import rope, rope_table

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
    """A bf16 decode step's layer as CUDA replays it in 9 kernels (37 before: q and k rotated apart through HF's
    rotate_half and written to the pool in two more, each norm seven kernels, each residual sum a kernel after its
    product, SiLU and its product two), its head in 3, the rest of the step in 11, an EAGLE-3 level in 18 (57
    before); with HF's norm arithmetic and torch's rotation and activation (the CPU's) 29, 9 and 51. By op, so that
    a change that brings back rotate_half (neg and cat), separate KV writes or rotations, a norm's separate cast, an
    unfused norm, a separate residual sum or a separate activation on CUDA fails here by name."""
    model = bench.target(torch.bfloat16)
    layer, head, rest = bench.layer_counts(model, torch.bfloat16, batch=4, tokens=1)
    ops = layer.counts
    assert ops["linear"] + ops["addmm"] == 4 and ops["attention"] == 1 and ops["rope_write"] == 1  # the layer's
    assert ops["roll"] == 0 and ops["index_put_"] == 0  # q and k rotated and k and v written by one kernel
    assert ops["rms_norm"] == 2 and ops["to"] == 0 and ops["mean"] == 0  # torch's fused norm, once a norm
    assert ops["addmm"] == 2 and ops["add"] == 0  # the residual sums inside o_proj's and down_proj's products
    assert ops["silu_mul"] == 1 and ops["silu"] == 0 and ops["mul"] == 0  # SiLU and its product: one kernel
    assert layer.total <= 9, dict(ops)
    assert head.total <= 3, dict(head.counts)
    # outside the layers: the embedding, the rows' slots, the RoPE rows; no block mask built (the paged kernel reads
    # the table: 26 kernels a FlexAttention step spent on its mask), no RoPE rows converted (their tables are), and
    # the slots one lookup of the table without slots()'s guards (kv_cache.step_slots: 17 -> 11)
    assert rest.counts["embedding"] == 1 and rest.counts["to"] == 0 and rest.counts["gather"] == 1
    assert rest.counts["where"] == 0 and rest.counts["clamp"] == 0 and rest.counts["full"] == 0
    assert rest.total <= 11, dict(rest.counts)
    level = bench.eagle3_counts(model, torch.bfloat16, batch=4)
    assert level.counts["rope_pair"] == 1 and level.counts["roll"] == 0 and level.counts["rms_norm"] == 4
    assert level.counts["addmm"] == 2 and level.total <= 18, dict(level.counts)

    hf_layer, hf_head, _ = bench.layer_counts(model, torch.bfloat16, batch=4, tokens=1, fused_norm=False)
    assert hf_layer.counts["to"] == 2  # the norms' float32 upcast; their downcast is inside the product
    rotation = hf_layer.counts
    assert rotation["roll"] == 1 and rotation["neg"] == 0 and rotation["cat"] == 0  # once, with no rotate_half
    assert rotation["index_put_"] == 2
    assert hf_layer.total <= 29 and hf_head.total <= 9, (dict(hf_layer.counts), dict(hf_head.counts))
    hf_level = bench.eagle3_counts(model, torch.bfloat16, batch=4, fused_norm=False)
    assert hf_level.counts["roll"] == 2 and hf_level.counts["neg"] == 0 and hf_level.total <= 51


def test_with_our_products_a_layer_is_six_kernels_and_the_head_two():
    """Where fused_ops measured our few-rows kernel faster for every product (CUDA), a bf16 decode layer's four
    products are four of its launches with the two norms and SiLU times up inside (6 kernels: the products, the
    rotation with the KV writes, attention) and the head one with the final norm inside, then the logits' float32
    copy; an EAGLE-3 level 16, its gate, up and head products with their norms inside; more rows than the kernel
    takes (a verify of 5 tokens over 16 rows) keep cuBLAS's products and the norms."""
    model = bench.target(torch.bfloat16)
    layer, head, _ = bench.layer_counts(model, torch.bfloat16, batch=4, tokens=1, products=True)
    assert dict(layer.counts) == {"few_rows": 4, "attention": 1, "rope_write": 1}
    assert head.counts["few_rows"] == 1 and head.total == 2, dict(head.counts)
    level = bench.eagle3_counts(model, torch.bfloat16, batch=4, products=True)  # its post-attention and final norms
    assert level.counts["rms_norm"] == 2 and level.total == 16, dict(level.counts)  # inside their products
    verify, _, _ = bench.layer_counts(model, torch.bfloat16, batch=4, tokens=5, products=True)
    assert dict(verify.counts) == dict(layer.counts)  # 20 rows: the same kernels (o reads attention's output as is)
    wide, _, _ = bench.layer_counts(model, torch.bfloat16, batch=16, tokens=5, products=True)
    assert wide.counts["few_rows"] == 0 and wide.counts["rms_norm"] == 2


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


def test_the_fused_norm_serves_cuda_inference_only_and_is_hf_to_a_last_bit():
    """llama.fused_norm picks torch's fused RMSNorm on CUDA outside autograd only; what it computes (one rounding,
    after the weight) is HF's norm to one bf16 ulp, and to float32 rounding in float32 (CPU here: the same law;
    tests/gpu/test_cuda_norm.py holds it on CUDA)."""
    import torch.nn.functional as F

    from rlspec.rollout.runtime.model.llama import fused_norm

    w = torch.ones(8, dtype=torch.bfloat16)
    assert not fused_norm(torch.ones(2, 8, dtype=torch.bfloat16), w)  # a CPU tensor
    g = torch.Generator().manual_seed(2)
    for dtype, rtol in ((torch.bfloat16, 2**-7), (torch.float32, 1e-6)):
        x = (torch.randn(64, 96, generator=g) * 4).to(dtype)
        norm = hf_qwen2.Qwen2RMSNorm(96, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_((1 + torch.randn(96, generator=g) * 0.3).to(dtype))
            fused, hf = F.rms_norm(x, (96,), norm.weight, 1e-6), norm(x)
        torch.testing.assert_close(fused.float(), hf.float(), rtol=rtol, atol=0)


def test_the_residual_sum_joins_its_product_in_cuda_inference_only(monkeypatch):
    """llama.plus_product: residual + linear(x), as one addmm where the norms are fused (CUDA inference, no bias),
    to one rounding of the separate sum in bf16 and to float32 rounding in float32; elsewhere it is the separate
    sum itself, bit for bit (CPU here with fused_norm forced; tests/gpu/test_cuda_norm.py holds it on CUDA)."""
    from rlspec.rollout.runtime.model import llama

    g = torch.Generator().manual_seed(3)
    for dtype, rtol in ((torch.bfloat16, 2**-7), (torch.float32, 1e-5)):
        lin = torch.nn.Linear(48, 32, bias=False).to(dtype)
        x, res = torch.randn(2, 3, 48, generator=g).to(dtype), torch.randn(2, 3, 32, generator=g).to(dtype)
        with torch.inference_mode():
            separate = res + lin(x)
            assert torch.equal(llama.plus_product(res, x, lin), separate)  # a CPU tensor: the separate sum
            with monkeypatch.context() as m:
                m.setattr(llama, "fused_norm", lambda x, weight: x.dtype == weight.dtype)  # as on CUDA
                joined = llama.plus_product(res, x, lin)
                biased = torch.nn.Linear(48, 32).to(dtype)
                assert torch.equal(llama.plus_product(res, x, biased), res + biased(x))  # a bias: separate
        assert joined.shape == separate.shape
        torch.testing.assert_close(joined.float(), separate.float(), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_a_deterministic_trees_verify_is_a_few_kernels_whatever_its_depth(temperature):
    """verify_tree on n-gram-style children (no q) draws one token per node at once and walks by matching, three
    kernels a depth: two chains of three below the root in 34 kernels sampled and 28 greedy (trying the children in
    turn, recursive rejection, took 173 and 73: a vocabulary pass per child tried), and a level deeper costs three
    more (53 and 22 before)."""
    from rlspec.rollout.speculation.verify import verify_tree
    from rlspec.rollout.types import SamplingParams

    def kernels(depth: int) -> int:
        B, N1, V = 64, 2 * depth + 1, 50
        g = torch.Generator().manual_seed(0)
        logits, tokens = torch.randn(B, N1, V, generator=g), torch.randint(0, V, (B, N1), generator=g)
        kids = [[1, 2]] + [[n + 2, -1] for n in range(1, N1 - 2)] + [[-1, -1]] * 2  # two chains below the root
        ops = bench.DeviceOps()
        with ops:
            verify_tree(logits, tokens, torch.tensor(kids).expand(B, N1, 2), SamplingParams(temperature=temperature),
                        None, torch.Generator().manual_seed(1), depth)
        return ops.total

    three = kernels(3)
    assert three <= (34 if temperature else 28), three
    assert kernels(4) - three == 3


def test_a_speculative_steps_launches_outside_the_forward_stay_few():
    """`python -m rlspec.bench kernels`'s step rows, at batch 8, sampled, the draws in torch ops (as on CUDA): a
    4-token n-gram chain step launched 25.5 kernels outside the forward and a tree step of width 2 50.9 when drafts
    were tested one by one; drawn and matched, ~19 and ~20. An EAGLE-3 chain step launched 71 while its features were
    gathered along a path built for it; staged as they are, 64 (bench_out/kernels.json)."""
    chain, tree, eagle3 = (bench.step_launches(mode, 8, 1.0)["launches_per_step"]
                           for mode in ("chain", "tree", "eagle3"))
    assert chain <= 22 and tree <= 24 and eagle3 <= 66, (chain, tree, eagle3)
