"""CUDA attention kernels (rollout/runtime/model/attention.py): FlexAttention with block masks built
from per-row lengths equals the dense reference at realistic head shapes, and prefill runs on the
fused SDPA kernels (flash for half types with grouped KV heads) without a mask tensor."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlspec.rollout.runtime.model import attention
from rlspec.rollout.runtime.model.attention import attend_causal, attend_dense, attend_flex, dense_step_mask, step_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY, SMOL, QWEN_1_5B, QWEN_7B = (4, 2, 16), (9, 3, 64), (12, 2, 128), (28, 4, 128)  # (heads, kv heads, head dim)


def _tree_rows(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(B, T, T, generator=g) < 0.5
    return (low.tril(-1) | torch.eye(T, dtype=torch.bool)).contiguous()


def _reference(q, k, v, start, T, S, tree):
    """The dense path on the CPU in float32: the exact masked softmax the engine is defined by."""
    mask = dense_step_mask(start.cpu(), T, S, None if tree is None else tree.cpu())
    return attend_dense(q.float().cpu(), k.float().cpu(), v.float().cpu(), mask)


# (dtype, heads, T, tree): T = 3 is padded to 4 queries inside; fp32 and bf16 at model-like shapes
CASES = [(torch.float32, TINY, 1, False), (torch.float32, TINY, 3, False), (torch.float32, TINY, 4, True),
         (torch.bfloat16, SMOL, 1, False), (torch.bfloat16, QWEN_1_5B, 4, True), (torch.bfloat16, QWEN_7B, 1, False)]


@pytest.mark.parametrize("dtype,heads,T,tree", CASES)
def test_flex_equals_dense_reference(dtype, heads, T, tree):
    H, KV, D = heads
    start = torch.tensor([5, 128, 126, 250, 380, 1, 40], device="cuda")  # inside, at, across block edges
    B, S = len(start), 384
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(B, H, T, D, device="cuda", generator=g).to(dtype)
    k, v = torch.randn(2, B, KV, S, D, device="cuda", generator=g).to(dtype)
    trees = _tree_rows(B, T, seed=T).cuda() if tree else None
    mask = step_mask(start, T, S, trees, flex=True)
    got = attend_flex(q, k, v, mask)
    assert attention.flex_error() is None, attention.flex_error()
    ref = _reference(q, k, v, start, T, S, trees)
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float().cpu(), ref, atol=atol, rtol=0), (got.float().cpu() - ref).abs().max()


def test_flex_batch_of_one_and_rows_at_the_cache_end():
    H, KV, D = TINY
    S, T = 256, 2
    start = torch.tensor([S - T], device="cuda")  # the new tokens fill the last positions of the cache
    q = torch.randn(1, H, T, D, device="cuda")
    k, v = torch.randn(2, 1, KV, S, D, device="cuda")
    got = attend_flex(q, k, v, step_mask(start, T, S, None, flex=True))
    assert attention.flex_error() is None, attention.flex_error()
    assert torch.allclose(got.cpu(), _reference(q, k, v, start, T, S, None), atol=1e-4, rtol=0)


@pytest.mark.parametrize("heads", [SMOL, QWEN_7B])
def test_bf16_prefill_runs_on_flash_with_grouped_heads(heads):
    """Under a flash-only context the call would raise if flash refused the shapes (GQA, no mask)."""
    H, KV, D = heads
    q = torch.randn(3, H, 200, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 3, KV, 200, D, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        got = attend_causal(q, k, v)
    tril = torch.ones(200, 200, dtype=torch.bool).tril()[None, None]
    ref = attend_dense(q.float().cpu(), k.float().cpu(), v.float().cpu(), tril)
    assert torch.allclose(got.float().cpu(), ref, atol=2e-2, rtol=0)


def test_fp32_prefill_runs_on_a_fused_kernel():
    H, KV, D = TINY
    q = torch.randn(2, H, 100, D, device="cuda")
    k, v = torch.randn(2, 2, KV, 100, D, device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = attend_causal(q, k, v)
    tril = torch.ones(100, 100, dtype=torch.bool).tril()[None, None]
    assert torch.allclose(got.cpu(), attend_dense(q.cpu(), k.cpu(), v.cpu(), tril), atol=1e-4, rtol=0)
