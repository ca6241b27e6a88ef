"""rollout/runtime/model/linear.py: packed oneDNN weights give bit for bit F.linear's output and follow weight
changes; the engine on packed weights decodes what it decodes without them; float32 few-row products taken
weight-major are F.linear's product, and only they are."""
import pytest
import torch
import torch.nn.functional as F

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.model import linear
from rlspec.rollout.runtime.model.linear import Linear, pack_linears, packable, unpack_linears
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts

needs_bf16 = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                                reason="needs oneDNN with a bf16 path (AVX512-BF16/AMX): elsewhere nothing is packed")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_is_f_linear_bit_for_bit(rows, bias):
    torch.manual_seed(rows)
    lin = Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
    ref = F.linear(x, lin.weight, lin.bias)
    lin.pack()
    assert torch.equal(lin(x), ref)


@needs_bf16
def test_packed_weight_follows_in_place_changes():
    """A policy sync or optimizer step writes the weight in place: the next call repacks."""
    lin = Linear(32, 48).to(torch.bfloat16)
    lin.pack()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    lin.weight = torch.nn.Parameter(torch.randn(48, 32, dtype=torch.bfloat16))  # new storage
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


@needs_bf16
def test_only_cpu_bf16_models_are_packed():
    assert not packable(Linear(4, 4)) and pack_linears(Linear(4, 4)) == 0  # float32: F.linear is as fast
    assert pack_linears(Linear(4, 4).to(torch.bfloat16)) == 4 * 4 * 2


@needs_bf16
def test_bf16_engine_on_packed_weights_decodes_as_unpacked_after_a_sync():
    """Greedy bf16 decoding with packed weights equals the same engine with packing removed, before and after
    load_weights changed every weight in place (the packed copies must follow)."""
    hf, hf2 = make_tiny_hf("llama", seed=0), make_tiny_hf("llama", seed=1)
    prompts = random_prompts(4, 3, 12, seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=12)

    def unpacked_run(weights_of):
        eng = RolloutEngine(loader.from_hf_model(weights_of, torch.bfloat16), None, eos_token_ids=[2], compile_mode="off")
        unpack_linears(eng.model)
        return [r.completion_ids for r in eng.generate(prompts, params)]

    eng = RolloutEngine(loader.from_hf_model(hf, torch.bfloat16), None, eos_token_ids=[2], compile_mode="off")
    assert any(isinstance(m, Linear) and m._packed is not None for m in eng.model.modules())
    assert [r.completion_ids for r in eng.generate(prompts, params)] == unpacked_run(hf)
    eng.load_weights(hf2.state_dict().items())
    after = unpacked_run(hf2)
    assert after != unpacked_run(hf)  # stale packed weights would decode the first model's text
    assert [r.completion_ids for r in eng.generate(prompts, params)] == after


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the weight-major product is taken where MKL is")
@pytest.mark.parametrize("bias", [False, True])
def test_float32_few_row_products_are_weight_major_and_f_linear_s_product(bias, monkeypatch):
    """2-128 rows outside autograd go weight-major (the route is spied on) and agree with F.linear to float32
    rounding, laid out row-major; one row, 129 rows, a weight under 1 MiB, a product under autograd and an unpacked
    model keep F.linear bit for bit."""
    taken = []
    spy = linear.weight_major_linear
    monkeypatch.setattr(linear, "weight_major_linear", lambda *a: taken.append(a[0].shape) or spy(*a))
    torch.manual_seed(0)
    lin = Linear(512, 520, bias=bias)  # 1.02 MiB
    for rows, routed in ((1, False), (2, True), (8, True), (128, True), (129, False)):
        x = torch.randn(rows, 1, 512)
        ref = F.linear(x, lin.weight, lin.bias)
        taken.clear()
        with torch.inference_mode():
            y = lin(x)
        assert taken == ([x.shape] if routed else [])
        assert y.shape == ref.shape and y.is_contiguous()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        if not routed:
            assert torch.equal(y, ref)
    small = Linear(512, 510, bias=False)  # 0.996 MiB: stays in cache
    x = torch.randn(8, 512)
    taken.clear()
    with torch.inference_mode():
        assert torch.equal(small(x), F.linear(x, small.weight)) and not taken
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias)) and not taken  # grad enabled: F.linear
    unpack_linears(lin)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias)) and not taken
