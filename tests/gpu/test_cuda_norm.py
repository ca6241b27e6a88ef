"""RMSNorm on CUDA is torch's fused kernel (llama.fused_norm): one kernel a norm (two at most) where HF's arithmetic
launches seven, HF's result to one bf16 ulp (float32: to rounding); a residual sum is inside its product
(llama.plus_product); autograd keeps HF's arithmetic."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2 import modeling_qwen2 as hf_qwen2

from rlspec.rollout.runtime.model.llama import RMSNorm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 2**-7), (torch.float32, 1e-6)])
def test_cuda_rmsnorm_is_one_fused_kernel_and_hf_to_a_last_bit(dtype, rtol):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(32, 3584, generator=g, device="cuda") * 4).to(dtype)
    ours, hf = RMSNorm(3584, 1e-6).to("cuda", dtype), hf_qwen2.Qwen2RMSNorm(3584, 1e-6).to("cuda", dtype)
    with torch.no_grad():
        ours.weight.copy_(1 + torch.randn(3584, generator=g, device="cuda").to(dtype) * 0.3)
        hf.weight.copy_(ours.weight)
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = ours(x)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 2, [e.name for e in kernels]  # HF's arithmetic: 7
    with torch.no_grad():
        assert torch.equal(out, F.rms_norm(x, (3584,), ours.weight, 1e-6))
        torch.testing.assert_close(out.float(), hf(x).float(), rtol=rtol, atol=0)
    xg = x.clone().requires_grad_(True)  # a drafter's training: HF's arithmetic, with its gradient
    assert torch.equal(ours(xg), hf(xg))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2**-7), (torch.float32, 1e-5)])
def test_cuda_residual_sum_is_inside_its_product(dtype, tol):
    """llama.plus_product on CUDA: residual + linear(x) with the sum inside the product (our few-rows kernel or
    torch's addmm, whichever fused_ops measured faster on the first call; cuBLAS may copy the residual to the output
    and split the sum over K), no separate elementwise sum; the separate sum's result to one rounding; under
    autograd, the separate sum."""
    from rlspec.rollout.runtime.model.llama import plus_product

    g = torch.Generator(device="cuda").manual_seed(1)
    lin = torch.nn.Linear(3584, 512, bias=False).to("cuda", dtype)
    x = torch.randn(8, 1, 3584, generator=g, device="cuda").to(dtype)
    res = torch.randn(8, 1, 512, generator=g, device="cuda").to(dtype)
    with torch.inference_mode():
        plus_product(res, x, lin)  # the first call of a shape times the two products (fused_ops._faster_here)
        torch.cuda.synchronize()
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        joined = plus_product(res, x, lin)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names and not any("elementwise" in n for n in names), names  # torch's separate sum: an elementwise add
    with torch.no_grad():
        torch.testing.assert_close(joined.float(), (res + lin(x)).float(), rtol=tol, atol=tol)
    xg = x.clone().requires_grad_(True)
    assert torch.equal(plus_product(res, xg, lin), res + lin(xg))
