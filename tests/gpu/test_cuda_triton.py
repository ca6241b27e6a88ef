"""Our Triton kernels compiled for the GPU. The paged decode attention (model/paged_decode.py): equal to the dense
reference at Qwen2.5-7B's heads over the pool's 128-position blocks, in bf16 and float32, decode and tree verify,
at contexts that split into many chunks; and replayed from a CUDA graph captured at one context, at others (each
row's chunks follow its live length inside the kernel). The rotation with the KV writes (model/rope_write.py):
the torch ops' bits, and the engine's steps take it (and a drafter's q and k rotation). SiLU times up (model/silu_mul.py): torch's two ops to a last
bit, and the MLPs of 16-bit CUDA steps take it. A plain step's draw (model/sample_rows.py): the inverse CDF of the
float64 softmax at Qwen2.5's vocabulary, batch 1 (a row over every SM) and 128, and the engine's draw takes it. A
product of a few rows (model/few_rows.py): one rounding of the float32 sum at Qwen2.5-7B's products, each row its own, the norm inside it torch's, chosen by timing against cuBLAS
before a graph captures it and replayed from the graph. And all of them at once in a bf16 engine replaying its steps
from graphs, plain and verifying drafts: its logprobs as close to the exact ones as the engine's with torch's ops
(tests/rollout/runtime/test_kernels_engine.py; the engine with torch's ops attends densely over the gathered blocks,
the paged kernel's fallback, so that nothing compiles for it)."""
import pytest
import torch

from tests.rollout.runtime import test_paged_decode as cpu_cases
from tests.rollout.runtime import test_rope_write as rope_cases
from tests.rollout.runtime import test_few_rows as product_cases
from tests.rollout.runtime import test_kernels_engine as engine_cases
from tests.rollout.runtime import test_silu_mul as silu_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
paged_decode = pytest.importorskip("rlspec.rollout.runtime.model.paged_decode", reason="needs triton")


@pytest.fixture(autouse=True)
def _cuda_blocks(monkeypatch):
    monkeypatch.setattr(cpu_cases, "BS", 128)  # the CUDA pool's block (attention.BLOCK)


@pytest.mark.parametrize("dtype,T,tree", [(torch.bfloat16, 1, False), (torch.bfloat16, 5, True),
                                          (torch.float32, 5, True)])
def test_cuda_kernel_is_the_dense_reference(dtype, T, tree):
    starts = [3, 127, 128, 700, 2047, 2100]
    args, ref = cpu_cases._case(len(starts), 28, 4, 128, T, starts, dtype, tree)
    got = paged_decode.paged_decode(*args)
    torch.testing.assert_close(got.double().cpu(), ref, atol=2e-5 if dtype == torch.float32 else 3e-2, rtol=0)


def test_cuda_dependent_launch_serves_from_sm90():
    """Our kernels launch with programmatic dependent launch on Hopper and later (model/pdl.py): its self-test (a kernel
    of ours after a torch kernel, a copy and itself, eager and replayed from a graph, equal to the chain without
    it) passed here; the graph tests in this file then replay PDL launches."""
    from rlspec.rollout.runtime.model import pdl

    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert pdl.serves(torch.ones(1, device="cuda", dtype=torch.bfloat16)) == hopper, "PDL's self-test failed here"


def test_cuda_graph_replay_follows_the_live_lengths():
    """Captured at short contexts, replayed after the rows' starts moved (another chunk length per row): the
    same as the kernel called eagerly on those starts."""
    starts = [900, 1500, 2000]
    args, _ = cpu_cases._case(len(starts), 28, 4, 128, 1, starts, torch.bfloat16, False)
    q, k_pool, v_pool, table, start, _ = args
    live = start.clone()
    live.copy_(torch.tensor([10, 130, 600], device="cuda"))
    paged_decode.paged_decode(q, k_pool, v_pool, table, live, None)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode.paged_decode(q, k_pool, v_pool, table, live, None)
    for moved in ([10, 130, 600], [899, 1499, 1999], [0, 1024, 256]):
        live.copy_(torch.tensor(moved, device="cuda"))
        graph.replay()
        torch.testing.assert_close(out, paged_decode.paged_decode(q, k_pool, v_pool, table, live, None),
                                   atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 on any machine: tests/rollout/runtime/test_rope_write.py
def test_cuda_rotation_and_writes_are_the_torch_ops_bit_for_bit(dtype):
    from rlspec.rollout.runtime.model import fused_ops

    qkv, cos, sin, k_pool, v_pool, slots = rope_cases._step(dtype, 28, 4, 128, B=8, T=3)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    q_ref = fused_ops.rotate_and_write(qkv, cos, sin, k_ref, v_ref, slots, 28, 4)
    with torch.inference_mode():
        fused = fused_ops.step_rotation(qkv)
    assert fused is not fused_ops.rotate_and_write  # what a CUDA step takes
    q = fused(qkv, cos, sin, k_pool, v_pool, slots, 28, 4)
    assert torch.equal(q, q_ref) and torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    q, k = qkv[:, :, :28].contiguous(), qkv[:, :, 28:32].contiguous()  # a drafter's separate products
    with torch.inference_mode():
        assert fused_ops.triton_serves(q, fused_ops._pair_error)  # what a drafter's level takes on CUDA
        got = fused_ops.rotate_pair(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, fused_ops.rope_pair(q, k, cos, sin)))


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 on any machine: tests/rollout/runtime/test_silu_mul.py
def test_cuda_silu_times_up_is_torchs_two_ops_to_a_last_bit(dtype):
    from rlspec.rollout.runtime.model import fused_ops

    silu_cases.test_one_kernel_is_torchs_two_to_a_last_bit(dtype, 18944)  # Qwen2.5-7B's intermediate width
    with torch.inference_mode():
        assert fused_ops.triton_serves(silu_cases._gate_up(dtype, rows=2), fused_ops._silu_error)  # what a CUDA MLP takes


def test_cuda_draw_inverts_the_cdf_at_qwens_vocabulary():
    from rlspec.rollout.runtime import sampling
    from tests.rollout.runtime import test_sample_rows as draw_cases

    for B, seed in ((1, 5), (128, 6)):  # the device's own split: one row over every SM, and one chunk a row
        x, r = draw_cases._case(max(B, 2), 152064, seed)
        x, r = x[:B], r[:B]
        tok, row = (t.cpu() for t in draw_cases._draw(x, r, 0.7))
        assert draw_cases._check(x, r, 0.7, tok, row) == []
    x = x.cuda()
    params = sampling.SamplingParams(temperature=0.7)
    assert sampling.device_draws(x, params)
    tok, row = sampling.sample_plain(x, params, torch.Generator("cuda").manual_seed(0))
    assert tok.is_cuda and row.shape == (128, 3) and not sampling._draw_error  # the kernels drew, nothing fell back


def test_cuda_products_of_a_few_rows_round_once_and_replay_from_a_graph():
    from rlspec.rollout.runtime.model import few_rows, fused_ops

    # Qwen2.5-7B's q|k|v (bias), o (the residual) and down products at 1, 5, 16, 32 and 64 rows (2 and 4 tiles)
    for M, N, K, bias, res in ((1, 4608, 3584, True, False), (5, 3584, 3584, False, True),
                               (16, 3584, 18944, False, True), (32, 4608, 3584, True, False),
                               (64, 3584, 18944, False, True)):
        product_cases.test_one_rounding_of_the_float32_sum(torch.bfloat16, M, N, K, bias, res)
    product_cases.test_each_row_is_its_own()
    x, w, _, r = product_cases._inputs(torch.bfloat16, 3, 3584, 18944, residual=True, seed=3)
    for stages in fused_ops.DEPTHS[1:]:  # every depth fused_ops times gives the same bits (sm_90: another pipeline)
        assert torch.equal(few_rows.product(x, w, None, r, stages=stages), few_rows.product(x, w, None, r))
    for M in (1, 20):  # SiLU times up inside: silu_mul's bits, then one rounding of the product
        product_cases.test_the_gated_product_is_silu_times_up_then_one_rounding_of_the_product(M)
    for M in (1, 4):  # the norm inside: torch's CUDA rms_norm, then the product
        product_cases.test_the_norm_inside_is_torchs_rms_norm_then_the_product(M)
    # the engine's normed variants at 7B's shapes (q|k|v with its bias; gate|up and the LM head), compiled here
    # once for the sections after (Triton's cache is the machine's)
    for N, bias in ((4608, True), (37888, False)):
        x, w, b, _ = product_cases._inputs(torch.bfloat16, 2, N, 3584, bias=bias)
        nw = torch.ones(3584, dtype=torch.bfloat16, device=x.device)
        torch.testing.assert_close(few_rows.product(x, w, b, None, nw, 1e-6).float(), fused_ops.torch_product(
            x, w, b, None, nw, 1e-6).float(), atol=0.05, rtol=0.02)
    x, w, _, r = product_cases._inputs(torch.bfloat16, 4, 3584, 3584, residual=True, seed=7)
    with torch.inference_mode():
        assert fused_ops.triton_serves(x, fused_ops._product_error)
        eager = fused_ops.product(x, w, None, r)  # times ours against cuBLAS for this shape, outside the capture
        chosen = fused_ops._faster[("product", tuple(w.shape), 4, False, True, torch.bfloat16, x.device)]
        ref = few_rows.product(x, w, None, r) if chosen else fused_ops.torch_product(x, w, None, r)
        assert torch.equal(eager, ref)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_ops.product(x, w, None, r)
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = few_rows.product(x, w, None, r) if chosen else fused_ops.torch_product(x, w, None, r)
        assert torch.equal(out, ref)
        linear = llama_linear(3584, 3584)
        with torch.no_grad():
            linear.weight.copy_(w)
        assert torch.equal(linear(x), fused_ops.product(x, w))  # a CUDA Linear's product is fused_ops.product's


def llama_linear(k: int, n: int):
    from rlspec.rollout.runtime.model.linear import Linear

    return Linear(k, n, bias=False).to(torch.bfloat16).cuda()


@pytest.mark.parametrize("speculate", [False, True])
def test_cuda_bf16_engine_through_our_kernels_in_graphs_is_as_exact_as_torchs_ops(monkeypatch, speculate):
    from tests.conftest import random_prompts
    from rlspec.rollout.runtime.model import attention

    hf = engine_cases.bf16_model("cuda", hidden_size=256, intermediate_size=512)  # SmolLM2's head size, 64
    prompts = random_prompts(6, 4, 30, seed=2, vocab=engine_cases.VOCAB)
    counts, engine = engine_cases.check_engine_through_our_kernels(monkeypatch, hf, speculate, prompts, 24,
                                                                   graph_mode="eager_start")
    assert counts["attend_paged"] > 0 and not attention._paged_error  # the paged kernel attended
    assert engine.runner.steps.counts["replays"] > 0  # steps replayed from graphs
