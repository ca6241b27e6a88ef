"""rollout/runtime/model/kernels: the bf16 few-row product of compiled verify steps.

The kernel's answer is the exact product rounded once to bf16 (float32 accumulation can move a value that sits
on a rounding boundary by one bf16 step, nothing more); compiled bf16 steps of 2-16 tokens go through it and
agree with the eager step; where it is switched off, such steps run eagerly as before. The sampling kernels' laws:
test_kernel_laws.py."""
import pytest
import torch

from rlspec.rollout.runtime.compiled import CompiledRunner
from rlspec.rollout.runtime.graphs import EagerRunner
from rlspec.rollout.runtime.model import kernels
from rlspec.rollout.runtime.model.loader import from_hf_model
from tests.conftest import make_tiny_hf
from tests.rollout.runtime.test_graphs import _runner, _tokens, _tree

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no AVX-512 BF16 CPU or no C++ toolchain")


def _bf16_ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps (at the exact value's magnitude) separate got from the exact float64 value."""
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return (got.double() - exact).abs() / ulp


@needs_kernel
@pytest.mark.parametrize("N,K", [(96, 64), (130, 100), (7, 45), (8, 32), (576, 1536)])
@pytest.mark.parametrize("M", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_is_the_rounded_exact_product(M, N, K, bias):
    """Every shape the kernel splits differently: K with and without a 32-element tail, N with and without an
    8-row tail, odd M (the last pass has one row). At most one bf16 step from the exact value, and exact for
    nearly all outputs; a wrong block/row/bias index or a dropped K tail breaks this by far more."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.1).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    got = kernels.small_linear(x, w, b)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    ulps = _bf16_ulps(got, exact)
    assert ulps.max() <= 1.0
    assert (got == exact.to(torch.bfloat16)).float().mean() >= 0.99
    # the blocked layout (zero-padded to 8 rows x 32 elements) makes the same products in the same order
    packed = kernels.pack(w)
    assert packed.shape == (-(-N // 8), -(-K // 32), 8, 32)
    assert torch.equal(kernels.packed_linear(x, packed, b, N), got)


@needs_kernel
def test_pack_rewrites_in_place_and_packed_linear_refuses_a_foreign_layout():
    w = torch.randn(20, 40).bfloat16()
    packed = kernels.pack(w)
    w2 = torch.randn(20, 40).bfloat16()
    assert kernels.pack(w2, packed) is packed  # compiled steps hold the tensor: a refresh keeps it
    x = torch.randn(3, 40).bfloat16()
    assert torch.equal(kernels.packed_linear(x, packed, None, 20), kernels.small_linear(x, w2))
    with pytest.raises(RuntimeError, match="pack"):
        kernels.packed_linear(x, w2, None, 20)  # a row-major weight is not the blocked layout


@needs_kernel
def test_small_linear_keeps_leading_dims_and_reads_strided_inputs():
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(64, 80).bfloat16().T  # [80, 64], not contiguous
    got = kernels.small_linear(x, w)
    torch.testing.assert_close(got, (x.float() @ w.float().T).bfloat16(), atol=0.05, rtol=0.02)
    assert got.shape == (2, 3, 80)


def _bf16_runner():
    return _runner(rows=8, length=64, n_prompts=4, dtype=torch.bfloat16, compile_mode="on")


@needs_kernel
@pytest.mark.parametrize("B,T,tree", [(1, 4, False), (1, 3, True), (1, 16, False)], ids=["chain4", "tree", "chain16"])
def test_compiled_bf16_verify_steps_use_the_kernel_and_match_eager(B, T, tree):
    """A bf16 verify step at batch 1 of up to 16 tokens compiles on the CPU (it ran eagerly before the kernel),
    calls the kernel, and gives the eager step's logits up to bf16 rounding (different accumulation order)."""
    from torch.profiler import ProfilerActivity, profile

    runner, lens = _bf16_runner()
    assert isinstance(runner.steps, CompiledRunner) and runner.steps.max_rows == kernels.MAX_ROWS
    start = lens[:B].clone()
    tokens = _tokens(B, T, seed=B + T)
    depths, mask = _tree(B) if tree else (None, None)
    if tree:
        tokens = _tokens(B, 4, seed=7)
    eager = EagerRunner(runner.model, runner.cache, "cpu")
    ref = eager.run(tokens, start, depths, mask)[0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = runner.step(tokens, start, depths, mask)[0]
    assert runner.steps.counts == {"fused": 0, "compiled": 1, "eager": 0}
    assert any(e.key == "rlspec_kernels::packed_linear" for e in prof.key_averages())
    torch.testing.assert_close(got, ref, atol=0.1, rtol=0.05)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_without_the_kernel_cpu_steps_of_several_tokens_run_eagerly(monkeypatch):
    """RLSPEC_CPU_KERNELS=0 (or a CPU without AVX-512 BF16): only single-token steps compile, as before."""
    monkeypatch.setenv(kernels.ENV, "0")
    kernels.available.cache_clear()
    monkeypatch.setattr(kernels, "ready", False)
    try:
        runner, lens = _bf16_runner()
        assert runner.steps.max_rows == 1
        runner.step(_tokens(1, 4), lens[:1])
        assert runner.steps.counts == {"fused": 0, "compiled": 0, "eager": 1}
    finally:
        kernels.available.cache_clear()


def test_float32_steps_never_take_the_kernel():
    model = from_hf_model(make_tiny_hf("llama"), torch.float32, "cpu")
    assert CompiledRunner.cpu_max_rows(model) == 1


@needs_kernel
def test_which_cpu_steps_compile(dynamo_only):
    """Up to 16 tokens in all over up to 8 rows (batch 1 up to 16 tokens, 8 rows of one or two); more tokens, or
    more than 8 rows, stay eager."""
    runner, lens = _bf16_runner()
    lens = torch.cat([lens, lens])  # 8 rows (4 prompts' caches read twice: fine for counting)
    runner.step(_tokens(4, 1), lens[:4])
    runner.step(_tokens(1, 16), lens[:1])
    runner.step(_tokens(2, 4), lens[:2])
    runner.step(_tokens(8, 2), lens[:8])
    assert runner.steps.counts == {"fused": 0, "compiled": 4, "eager": 0}
    runner.step(_tokens(1, 17), lens[:1])
    runner.step(_tokens(4, 8), lens[:4])
    assert runner.steps.counts == {"fused": 0, "compiled": 4, "eager": 2}


@needs_kernel
def test_compiled_bf16_batched_decode_step_matches_eager():
    runner, lens = _bf16_runner()
    tokens = _tokens(4, 1, seed=11)
    ref = EagerRunner(runner.model, runner.cache, "cpu").run(tokens, lens)[0]
    got = runner.step(tokens, lens)[0]
    assert runner.steps.counts == {"fused": 0, "compiled": 1, "eager": 0}
    torch.testing.assert_close(got, ref, atol=0.1, rtol=0.05)


@needs_kernel
def test_compiled_steps_follow_a_weight_sync():
    """Compiled steps read the kernel's blocked copies of the weights, which a sync must rewrite: after
    load_weights an engine samples what an engine built on the new weights samples."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.types import SamplingParams
    from tests.conftest import random_prompts

    old, new = make_tiny_hf("llama", seed=0), make_tiny_hf("llama", seed=1)
    prompts, params = random_prompts(3, 4, 9, seed=5), SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)

    def engine(hf):
        return RolloutEngine(from_hf_model(hf, torch.bfloat16), None, compile_mode="on", eos_token_ids=[2])

    synced, fresh = engine(old), engine(new)
    before = [r.completion_ids for r in synced.generate(prompts, params)]
    synced.load_weights(new.state_dict().items())
    after = [r.completion_ids for r in synced.generate(prompts, params)]
    assert after == [r.completion_ids for r in fresh.generate(prompts, params)] and after != before
    assert isinstance(synced.runner.steps, CompiledRunner) and synced.runner.steps.counts["compiled"] > 0


@needs_kernel
def test_fast_linear_follows_the_drafters_weight_changes():
    """The learned drafter's products: the kernel on a blocked copy that is made again when the weight changes
    in place (an optimizer step, load_state_dict) or is replaced (assign=True); gradients on: the module itself."""
    from torch import nn

    from rlspec.rollout.runtime.model.linear import fast_linear

    layer = nn.Linear(40, 20).bfloat16()
    x = torch.randn(2, 40).bfloat16()
    with torch.no_grad():
        assert torch.equal(fast_linear(layer, x), kernels.small_linear(x, layer.weight, layer.bias))
        layer.weight.mul_(-1)
        assert torch.equal(fast_linear(layer, x), kernels.small_linear(x, layer.weight, layer.bias))
        layer.load_state_dict({"weight": torch.randn(20, 40).bfloat16(), "bias": layer.bias}, assign=True)
        assert torch.equal(fast_linear(layer, x), kernels.small_linear(x, layer.weight, layer.bias))
    assert fast_linear(layer, x.requires_grad_()).grad_fn is not None  # training: autograd's path


@needs_kernel
def test_warm_compiles_every_graph_the_steps_will_use(dynamo_only):
    """Graphs compiled ahead (Speculation.calibrate calls it with 1 + each draft size): no step of those sizes
    compiles afterwards, so no compilation lands inside a rollout (or a selector's timing). Contexts of two
    blocks or more, as every chat prompt has: dynamo gives a one-block context a graph of its own."""
    from rlspec.rollout.runtime.runner import compiled_frames

    runner, lens = _bf16_runner()
    lens = lens.clamp_min(17)  # the cache rows hold garbage past the prompts: fine for counting compiles
    runner.steps.warm([1, 3, 5], rows=4)
    assert {(False, 1), (True, 1), (False, 4), (False, 8)} <= runner.steps.seen
    frames = compiled_frames()
    for B, T in [(1, 1), (1, 3), (1, 4), (1, 5), (3, 1), (4, 1)]:  # T buckets 1, 4, 8
        with torch.inference_mode():  # as the decode loop steps (engine.py): dynamo guards on the mode
            runner.step(_tokens(B, T), lens[:B])
        assert not runner.fresh, (B, T)
    assert compiled_frames() == frames


def _exact_attention(q, k_pool, v_pool, blocks, mask, scale):
    """float64 attention of q [B, H, T, D] over each row's positions, gathered one by one from the pool."""
    B, H, T, D = q.shape
    bs, KV = k_pool.shape[1], k_pool.shape[2]
    S = mask.shape[-1]
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        keys = torch.stack([k_pool[blocks[b, s // bs], s % bs] for s in range(S)]).double()  # [S, KV, D]
        vals = torch.stack([v_pool[blocks[b, s // bs], s % bs] for s in range(S)]).double()
        for h in range(H):
            kv = h // (H // KV)
            scores = (q[b, h].double() @ keys[:, kv].T) * scale  # [T, S]
            scores = scores.masked_fill(~mask[b, 0], float("-inf"))
            out[b, h] = torch.softmax(scores, -1) @ vals[:, kv]
    return out


@needs_kernel
@pytest.mark.parametrize("B,H,KV,T,D,ctx,tree", [
    (1, 9, 3, 1, 64, 200, False),     # SmolLM2's heads, one decode token
    (1, 9, 3, 4, 64, 700, True),      # a tree verify over three position chunks
    (3, 8, 2, 16, 128, 300, True),    # rows of different lengths, 16 tokens, head size 128
    (2, 4, 4, 2, 96, 40, False),      # no grouping, a head size with no register path
    (4, 6, 1, 1, 64, 530, False),     # one KV head for all, rows ending in different chunks
])
def test_paged_attention_is_the_exact_attention(B, H, KV, T, D, ctx, tree):
    """The kernel against float64 attention computed position by position from the pool: within one bf16 step
    of the output's scale, and the bf16 rounding of the exact value for nearly all outputs. Pools with blocks
    in random order (a row's blocks are not adjacent), rows whose lengths differ (the kernel skips what no query
    sees), contexts over several 256-position chunks (their partial softmaxes merged). A wrong chunk rescale, a
    mask read off by one position or a wrong KV head breaks this by far more."""
    from rlspec.rollout.runtime.model.attention import dense_step_mask

    g = torch.Generator().manual_seed(B * 100 + T + D)
    bs = 16
    n = -(-(ctx + T) // bs)
    nb = B * n + 5
    k_pool = torch.randn(nb, bs, KV, D, generator=g).bfloat16()
    v_pool = torch.randn(nb, bs, KV, D, generator=g).bfloat16()
    blocks = torch.stack([torch.randperm(nb, generator=g)[:n] for _ in range(B)])
    start = torch.randint(max(ctx - 300, 1), ctx + 1, (B,), generator=g)
    start[0] = ctx
    tm = None
    if tree:
        tm = (torch.rand(B, T, T, generator=g) < 0.5).tril() | torch.eye(T, dtype=torch.bool)
    mask = dense_step_mask(start, T, n * bs, tm)
    q = (torch.randn(B, H, T, D, generator=g) * 2).bfloat16()
    exact = _exact_attention(q, k_pool, v_pool, blocks, mask, D ** -0.5)
    got = kernels.paged_attention(q, k_pool, v_pool, blocks, mask, D ** -0.5)
    assert got.shape == (B, H, T, D) and got.dtype == torch.bfloat16
    scale = exact.abs().amax(-1, keepdim=True)
    assert ((got.double() - exact).abs() / scale).max() <= 2 ** -8
    assert (got == exact.to(torch.bfloat16)).float().mean() >= 0.9


@needs_kernel
@pytest.mark.parametrize("compile_mode,heads", [("off", 4), ("on", 4), ("off", 32)])
def test_bf16_steps_attend_through_the_kernel(compile_mode, heads, monkeypatch):
    """A bf16 CPU step (eager or compiled; decode, chain and tree) reads its cache through paged_attention
    where the head size allows, whatever the head count (more heads than the kernel's 16 tokens a row, as a
    7B model has), and gives the logits of the gather-and-matmul path it replaced, up to bf16 rounding. (Fused
    steps, which would take these shapes, call it from C++: test_fused.py covers them.)"""
    from torch.profiler import ProfilerActivity, profile

    from rlspec.rollout.runtime.model import fused

    monkeypatch.setattr(fused, "enabled", False)
    runner, lens = _runner(rows=8, length=64, n_prompts=4, dtype=torch.bfloat16, compile_mode=compile_mode,
                           head_dim=32, num_attention_heads=heads)
    for B, T, tree in [(2, 1, False), (1, 4, False), (1, 4, True)]:
        tokens = _tokens(B, T, seed=B + T)
        depths, tmask = _tree(B) if tree else (None, None)
        with monkeypatch.context() as m:
            m.setattr(kernels, "attention_usable", lambda q, pool: False)
            ref = EagerRunner(runner.model, runner.cache, "cpu").run(tokens, lens[:B], depths, tmask)[0]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = runner.step(tokens, lens[:B], depths, tmask)[0]
        assert any(e.key == "rlspec_kernels::paged_attention" for e in prof.key_averages()), (B, T, tree)
        torch.testing.assert_close(got, ref, atol=0.1, rtol=0.05)
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
