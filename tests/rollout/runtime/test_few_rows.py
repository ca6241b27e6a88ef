"""A product of a few rows as one Triton kernel (model/few_rows.py) against float64, in bf16 and fp16, with and
without a bias and a residual, on shapes that are and are not multiples of its tiles: one rounding to nearest even
of the float32 sum (almost everywhere the float64 result rounded, never a full spacing off); each row's result its
own, whatever the other rows; and a Linear and a layer's residual sum take it only where fused_ops.product measured
it faster, with a fallback that warns. On CUDA compiled; elsewhere through Triton's interpreter (TRITON_INTERPRET,
tests/conftest.py)."""
from __future__ import annotations

import os

import pytest
import torch

from rlspec.rollout.runtime.model import fused_ops, llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before triton is imported)", allow_module_level=True)
few_rows = pytest.importorskip("rlspec.rollout.runtime.model.few_rows", reason="needs triton")


def _inputs(dtype, M, N, K, bias=False, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    r = torch.randn(M, N, generator=g).to(dtype).to(DEVICE) if residual else None
    return x, w, b, r


def _exact(x, w, b, r) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + (0 if b is None else b.double()) + (0 if r is None else r.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,bias,residual", [(1, 48, 300, True, False), (5, 70, 1100, False, True),
                                                 (16, 40, 64, True, True), (3, 33, 520, False, False),
                                                 (27, 36, 200, True, True), (50, 36, 200, False, True)])
def test_one_rounding_of_the_float32_sum(dtype, M, N, K, bias, residual):
    x, w, b, r = _inputs(dtype, M, N, K, bias, residual)
    got = few_rows.product(x, w, b, r)
    assert got.shape == (M, N) and got.dtype == dtype
    exact = _exact(x, w, b, r)
    # the spacing of dtype's numbers at each result: rounded once to nearest, a float32 sum is within half of it
    # plus the float32 sum's own error (at most K units of float32 roundoff of the sum of |x| |w|)
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-3))))
    slack = K * 2.0 ** -24 * (x.abs().double() @ w.abs().double().T)
    assert ((got.double() - exact).abs() <= ulp + slack).all()
    assert (got == exact.to(dtype)).double().mean() > 0.97  # rounded to nearest (truncation: ~half the bits)


def test_each_row_is_its_own():
    """A row's result has the same bits alone, among 5 rows, 16 (one tile) or 40 (three), and wherever it sits: a
    verify of T tokens and a decode step give a token's product the same value."""
    x, w, b, r = _inputs(torch.bfloat16, 40, 72, 700, bias=True, residual=True, seed=3)
    full = few_rows.product(x, w, b, r)
    assert torch.equal(few_rows.product(x[:5], w, b, r[:5]), full[:5])
    assert torch.equal(few_rows.product(x[7:8], w, b, r[7:8])[0], full[7])
    assert torch.equal(few_rows.product(x[20:21], w, b, r[20:21])[0], full[20])  # the second tile's
    assert torch.equal(few_rows.product(x[:16], w, b, r[:16]), full[:16])
    assert torch.equal(few_rows.product(x[:32], w, b, r[:32]), full[:32])
    flip = torch.arange(39, -1, -1)
    assert torch.equal(few_rows.product(x[flip], w, b, r[flip]), full[flip])
    odd = torch.tensor([30, 2, 17, 9, 16, 0, 25, 39])  # 8 rows from three tiles, in one
    assert torch.equal(few_rows.product(x[odd], w, b, r[odd]), full[odd])


@pytest.mark.parametrize("M", [1, 4])
def test_the_norm_inside_is_torchs_rms_norm_then_the_product(M):
    """With the norm's weight, the kernel's product is that of torch's fused rms_norm (float32, rounded once):
    almost everywhere the same bits as the kernel's product of torch's normalised rows."""
    x, w, b, _ = _inputs(torch.bfloat16, M, 72, 1100, bias=True, seed=9)
    x = x * 7 + 3  # away from unit scale: a norm that did nothing would show
    nw = (1 + torch.randn(1100, generator=torch.Generator().manual_seed(2)) / 4).to(torch.bfloat16).to(DEVICE)
    got = few_rows.product(x, w, b, None, nw, 1e-6)
    unfused = few_rows.product(torch.nn.functional.rms_norm(x, (1100,), nw, 1e-6), w, b)
    assert (got == unfused).double().mean() > 0.97
    torch.testing.assert_close(got.float(), unfused.float(), atol=0.02, rtol=0.02)
    assert torch.equal(few_rows.product(x[:1], w, b, None, nw, 1e-6)[0], got[0])  # each row its own


@pytest.mark.parametrize("M", [1, 3, 20])
def test_the_gated_product_is_silu_times_up_then_one_rounding_of_the_product(M):
    """Gated, x is an MLP's gate|up product and the kernel computes silu(gate) * up as it loads it, with silu_mul.py's
    bits; the product of those, with the residual, is one rounding of its float32 sum (as any product here), each
    row its own."""
    from rlspec.rollout.runtime.model import silu_mul

    K = 600
    gate_up, w, _, r = _inputs(torch.bfloat16, M, 48, 2 * K, residual=True, seed=11)
    w = w[:, :K].contiguous()
    got = few_rows.product(gate_up, w, None, r, gated=True)
    h = silu_mul.silu_mul(gate_up, K)  # the activation's bits, which the product's x must have
    exact = _exact(h, w, None, r)
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-3))))
    assert ((got.double() - exact).abs() <= ulp + K * 2.0 ** -24 * (h.abs().double() @ w.abs().double().T)).all()
    assert (got == exact.to(torch.bfloat16)).double().mean() > 0.97
    assert torch.equal(few_rows.product(gate_up[-1:], w, None, r[-1:], gated=True), got[-1:])
    with pytest.raises(ValueError, match="gated: x is gate\\|up"):
        few_rows.product(gate_up[:, :K], w, None, r, gated=True)


def test_wide_products_take_tiles_of_32_outputs():
    """Past 16,384 outputs (a 7B layer's gate|up, an LM head) each program takes 32 rows of W: the same one rounding,
    with the norm inside and the last tile cut by N (every access inside the tensors: tests/triton_bounds.py)."""
    N, K = 16384 + 40, 96
    assert few_rows.tiles(N, K) == (32, 128) and few_rows.tiles(16384, K)[0] == 16
    x, w, b, r = _inputs(torch.bfloat16, 3, N, K, bias=True, residual=True, seed=5)
    got = few_rows.product(x, w, b, r)
    exact = _exact(x, w, b, r)
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-3))))
    assert ((got.double() - exact).abs() <= ulp + K * 2.0 ** -24 * (x.abs().double() @ w.abs().double().T)).all()
    nw = torch.full((K,), 1.5, dtype=torch.bfloat16, device=DEVICE)
    normed = few_rows.product(x, w, None, None, nw, 1e-6)
    assert (normed == few_rows.product(torch.nn.functional.rms_norm(x, (K,), nw, 1e-6), w)).double().mean() > 0.97


def test_more_rows_than_a_tile_are_refused():
    x, w, _, _ = _inputs(torch.bfloat16, few_rows.MAX_ROWS + 1, 16, 64)
    with pytest.raises(ValueError, match="at most 64 rows"):
        few_rows.product(x, w)
    assert fused_ops.FEW_ROWS == few_rows.MAX_ROWS


def test_the_kernel_serves_where_measured_faster_once_per_shape_and_row_bucket(monkeypatch, request):
    """fused_ops.product times our kernel against torch's product once per (shape, row bucket) and keeps the faster;
    a layer's residual sum (llama.plus_product) and a Linear go through it."""
    x, w, b, r = _inputs(torch.bfloat16, 3, 40, 256, bias=True, residual=True, seed=5)
    monkeypatch.setattr(fused_ops, "triton_serves", lambda t, errors: not errors)
    monkeypatch.setattr(fused_ops, "_timed_here", lambda t: True)  # the timer below stands in for CUDA events
    request.addfinalizer(fused_ops.forget_choices)
    timed = []
    speeds = {"ours": 1.0, "torch": 2.0}

    def seconds(fn, *args, **launch):
        which = "torch" if fn is fused_ops.torch_product else "ours"
        timed.append(which)
        return speeds[which]

    monkeypatch.setattr(fused_ops, "_seconds", seconds)
    ours, theirs = few_rows.product(x, w, b, r), fused_ops.torch_product(x, w, b, r)
    assert not torch.equal(ours, theirs)  # two roundings (torch: product, then sum) against one
    assert torch.equal(fused_ops.product(x, w, b, r), ours) and timed == ["ours", "ours", "torch"]  # two depths
    assert torch.equal(fused_ops.product(x[:1], w, b, r[:1]), ours[:1]) and len(timed) == 6  # bucket 1: timed
    assert torch.equal(fused_ops.product(x[:2], w, b, r[:2]), ours[:2]) and len(timed) == 9  # bucket 2
    assert torch.equal(fused_ops.product(x[1:3], w, b, r[1:3]), ours[1:3]) and len(timed) == 9  # kept
    choices = fused_ops.product_choices()
    assert [(c["rows"], c["ours"], c["ours_us"], c["torch_us"]) for c in choices] == \
        [(4, True, 1e6, 2e6), (1, True, 1e6, 2e6), (2, True, 1e6, 2e6)]
    speeds["ours"] = 3.0  # slower for a new shape: torch's
    assert torch.equal(fused_ops.product(x, w[:24], b[:24], r[:, :24]), fused_ops.torch_product(x, w[:24], b[:24],
                                                                                               r[:, :24]))
    # a layer's residual sum with a product without bias takes the same path
    linear = llama.Linear(256, 40, bias=False).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        linear.weight.copy_(w)
        monkeypatch.setattr(llama, "fused_norm", lambda t, weight: True)
        speeds["ours"] = 0.5
        assert torch.equal(llama.plus_product(r, x, linear), few_rows.product(x, w, None, r))
        if DEVICE == "cpu":  # a CPU Linear goes straight to F.linear (no choice to make; tests/gpu: a CUDA one's)
            assert torch.equal(linear(x), torch.nn.functional.linear(x, w))


def test_more_rows_and_other_devices_take_torchs_product():
    x, w, b, r = _inputs(torch.bfloat16, 80, 40, 64, bias=True)
    assert torch.equal(fused_ops.product(x, w, b), torch.nn.functional.linear(x, w, b))  # 80 rows: a GEMM's work
    if DEVICE == "cpu":  # triton_serves: CUDA only
        assert torch.equal(fused_ops.product(x[:4], w, b), torch.nn.functional.linear(x[:4], w, b))


def test_a_failing_kernel_warns_and_torch_serves_from_then_on(monkeypatch, request):
    x, w, b, _ = _inputs(torch.bfloat16, 2, 40, 64, bias=True)
    monkeypatch.setattr(fused_ops, "triton_serves", lambda t, errors: not errors)
    monkeypatch.setattr(fused_ops, "_timed_here", lambda t: True)
    monkeypatch.setattr(fused_ops, "_faster_here", lambda *args: True)

    def broken(*args):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(fused_ops, "_kernel", lambda module, name: broken)
    request.addfinalizer(fused_ops._product_error.clear)
    ref = torch.nn.functional.linear(x, w, b)
    with pytest.warns(RuntimeWarning, match="the Triton product kernel failed"):
        assert torch.equal(fused_ops.product(x, w, b), ref)
    assert fused_ops._product_error and torch.equal(fused_ops.product(x, w, b), ref)


def test_our_kernel_serves_at_its_fastest_pipeline_depth(monkeypatch, request):
    """Our kernel is timed at each of fused_ops.DEPTHS; the fastest is what serves the shape (its stages passed to
    the launch), what the device check reports, and, where our kernel loses at every depth, torch's serves."""
    x, w, b, _ = _inputs(torch.bfloat16, 2, 40, 64, bias=True)
    monkeypatch.setattr(fused_ops, "triton_serves", lambda t, errors: not errors)
    monkeypatch.setattr(fused_ops, "_timed_here", lambda t: True)
    request.addfinalizer(fused_ops.forget_choices)
    speeds = {3: 1.5, 4: 1.0, "torch": 1.2}
    monkeypatch.setattr(fused_ops, "_seconds", lambda fn, *args, **launch: speeds["torch"] if fn is
                        fused_ops.torch_product else speeds[launch.get("stages", 3)])
    launched = []
    product = fused_ops._kernel("few_rows", "product")
    monkeypatch.setattr(fused_ops, "_kernel", lambda module, name: lambda *args, **launch: launched.append(launch)
                        or product(*args, **launch))
    assert torch.equal(fused_ops.product(x, w, b), few_rows.product(x, w, b)) and launched == [dict(stages=4)]
    assert [(c["ours"], c["stages"], c["ours_us"]) for c in fused_ops.product_choices()] == [(True, 4, 1e6)]
    speeds[4] = 1.3  # another shape, where both depths lose to torch's
    assert torch.equal(fused_ops.product(x, w[:24], b[:24]), torch.nn.functional.linear(x, w[:24], b[:24]))
    assert len(launched) == 1 and fused_ops.product_choices()[-1]["ours"] is False
    speeds[4] = 1.19  # a third, where ours is faster by less than MARGIN: a tie, and torch's serves
    assert torch.equal(fused_ops.product(x, w[:16], b[:16]), torch.nn.functional.linear(x, w[:16], b[:16]))
    assert len(launched) == 1 and fused_ops.product_choices()[-1]["ours"] is False


def test_a_depth_the_device_cannot_hold_is_dropped_and_the_default_serves(monkeypatch, request):
    """A launch at a deeper pipeline that fails (more shared memory than the device has: Triton's OutOfResources)
    leaves that depth out of the choice; the kernel at its default depth serves, with no failure recorded."""
    x, w, b, _ = _inputs(torch.bfloat16, 2, 40, 64, bias=True)
    monkeypatch.setattr(fused_ops, "triton_serves", lambda t, errors: not errors)
    monkeypatch.setattr(fused_ops, "_timed_here", lambda t: True)
    request.addfinalizer(fused_ops.forget_choices)
    product = fused_ops._kernel("few_rows", "product")

    def refusing(*args, **launch):
        if launch.get("stages", 3) > 3:
            raise RuntimeError("out of resources: shared memory")
        return product(*args, **launch)

    monkeypatch.setattr(fused_ops, "_kernel", lambda module, name: refusing)
    monkeypatch.setattr(fused_ops, "_seconds", lambda fn, *args, **launch: 2.0 if fn is fused_ops.torch_product
                        else fn(*args, **launch) is not None and 1.0)
    assert torch.equal(fused_ops.product(x, w, b), few_rows.product(x, w, b))
    assert not fused_ops._product_error and [c["stages"] for c in fused_ops.product_choices()] == [3]


def test_a_timing_that_fails_warns_and_leaves_the_shape_to_torch(monkeypatch, request):
    x, w, b, _ = _inputs(torch.bfloat16, 2, 40, 64, bias=True)
    monkeypatch.setattr(fused_ops, "triton_serves", lambda t, errors: not errors)
    monkeypatch.setattr(fused_ops, "_timed_here", lambda t: True)
    request.addfinalizer(fused_ops.forget_choices)

    def broken(fn, *args, **launch):
        raise RuntimeError("no events here")

    monkeypatch.setattr(fused_ops, "_seconds", broken)
    with pytest.warns(RuntimeWarning, match="torch's product serves this shape"):
        assert torch.equal(fused_ops.product(x, w, b), torch.nn.functional.linear(x, w, b))
    assert [c["ours"] for c in fused_ops.product_choices()] == [False]
    assert torch.equal(fused_ops.product(x, w, b), torch.nn.functional.linear(x, w, b))  # kept: timed once


def _as_on_cuda(monkeypatch, request) -> dict:
    """Our kernels serve as they do on CUDA (the norms fused; Triton's interpreter runs them), each choice timed by a
    stand-in: speeds["ours"] seconds (the returned dict, 1 until changed) against torch's 2; the choices forgotten
    after the test."""
    speeds = {"ours": 1.0}
    monkeypatch.setattr(fused_ops, "triton_serves", lambda t, errors: not errors)
    monkeypatch.setattr(fused_ops, "_timed_here", lambda t: True)
    monkeypatch.setattr(llama, "fused_norm", lambda t, weight: True)
    monkeypatch.setattr(fused_ops, "_seconds",
                        lambda fn, *a, **launch: speeds["ours"] if fn is fused_ops._fused_product else 2.0)
    request.addfinalizer(fused_ops.forget_choices)
    return speeds


def test_a_layer_takes_its_norm_into_the_product_where_measured_faster(monkeypatch, request):
    """A decoder layer's q|k|v and gate|up products and the LM head take their norm inside our kernel where
    fused_ops.normed_product measured it faster than the norm and the product apart; elsewhere (any CPU) the
    layer computes linear(norm(x)) as before, bit for bit."""
    norm = llama.RMSNorm(256, 1e-6).to(torch.bfloat16).to(DEVICE)
    linear = llama.Linear(256, 40, bias=True).to(torch.bfloat16).to(DEVICE)
    x = (torch.randn(2, 1, 256, generator=torch.Generator().manual_seed(4)) * 5).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        assert torch.equal(llama.normed(norm, linear, x), linear(norm(x)))  # the CPU's path
        assert torch.equal(llama.normed(None, linear, x), linear(x))
        _as_on_cuda(monkeypatch, request)
        got = llama.normed(norm, linear, x)
        assert torch.equal(got, few_rows.product(x, linear.weight, linear.bias, None, norm.weight, 1e-6))
        assert [c["kind"] for c in fused_ops.product_choices()] == ["normed"]


def test_an_mlp_takes_silu_into_its_down_product_where_measured_faster(monkeypatch, request):
    """A decoder layer's MLP with its residual computes SiLU times up inside the down product where
    fused_ops.gated_product measured that faster than SiLU's kernel and the product apart; else, and on any CPU, as
    before, bit for bit."""
    from rlspec.rollout.runtime.model import loader
    from tests.conftest import make_tiny_hf

    mlp = loader.from_hf_model(make_tiny_hf("llama").to(torch.bfloat16), device=DEVICE).model.layers[0].mlp
    g = torch.Generator().manual_seed(6)
    x, res = (torch.randn(3, 1, 64, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    with torch.no_grad():
        before = mlp(x, res)
        gate_up = mlp.gate_up_proj(x)
        assert torch.equal(before, res + mlp.down_proj(fused_ops.silu_times(gate_up, 128)))  # the CPU's path
        speeds = _as_on_cuda(monkeypatch, request)
        got = mlp(x, res)
        assert torch.equal(got, few_rows.product(gate_up, mlp.down_proj.weight, None, res, gated=True))
        assert [c["kind"] for c in fused_ops.product_choices()] == ["gated"]  # (a CPU Linear's is F.linear's)
        fused_ops.forget_choices()
        speeds["ours"] = 3.0  # slower: SiLU's kernel, then the product with the residual
        assert torch.equal(mlp(x, res), fused_ops.torch_product(fused_ops.silu_times(gate_up, 128),
                                                                  mlp.down_proj.weight, None, res))


def test_a_drafter_level_takes_its_norms_into_its_products_where_measured_faster(monkeypatch, request):
    """An EAGLE-3 level's gate and up products (after its post-attention norm) and its draft head (after the final
    norm) take the norm inside our kernel where fused_ops measured that faster (one choice for products of one
    shape); where torch's serve, gate and up share one norm, and on any CPU the level is as before, bit for bit."""
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.runtime.model.linear import fast_linear
    from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model, normed_products
    from tests.conftest import make_tiny_hf

    target = loader.from_hf_model(make_tiny_hf("llama").to(torch.bfloat16))
    drafter = Eagle3Model(Eagle3Config.for_target(target.cfg, draft_vocab_size=48)).to(torch.bfloat16).to(DEVICE)
    norm, linears = drafter.midlayer.post_attention_layernorm, (drafter.midlayer.mlp.gate_proj,
                                                                drafter.midlayer.mlp.up_proj)
    x = (torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(8)) * 4).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        unfused = [fast_linear(linear, norm(x)) for linear in linears]
        assert all(torch.equal(a, b) for a, b in zip(normed_products(norm, linears, x), unfused))  # the CPU's
        speeds = _as_on_cuda(monkeypatch, request)
        got = normed_products(norm, linears, x)
        for out, linear in zip(got, linears):
            assert torch.equal(out, few_rows.product(x, linear.weight, None, None, norm.weight, norm.eps))
        assert [c["kind"] for c in fused_ops.product_choices()] == ["normed"]  # gate's and up's shape: one choice
        logits = drafter.logits(x)
        assert torch.equal(logits, few_rows.product(x, drafter.lm_head.weight, None, None, drafter.norm.weight,
                                                    drafter.norm.eps).float())
        fused_ops.forget_choices()
        speeds["ours"] = 3.0  # slower: the norm (torch's fused one, as on CUDA) once, then torch's products
        torch_way = [fast_linear(linear, norm(x)) for linear in linears]
        calls = []
        monkeypatch.setattr(norm, "forward", lambda t, f=norm.forward: calls.append(1) or f(t))
        assert all(torch.equal(a, b) for a, b in zip(normed_products(norm, linears, x), torch_way)) and len(calls) == 1


@pytest.mark.parametrize("rows,T", [(5, 1), (2, 4)])
def test_a_model_step_through_the_kernels_is_the_torch_step_to_rounding(monkeypatch, request, rows, T):
    """A bf16 step of a tiny model with every product and norm it can take through our kernel (as on CUDA, where
    measured faster): the layers' q|k|v and gate|up with their norms, o with the residual sum, down with SiLU times
    up and the residual sum, the LM head with the final norm. Its logits are the torch step's up to bf16 rounding,
    and its greedy tokens the same."""
    from rlspec.rollout.runtime.graphs import EagerRunner
    from tests.rollout.runtime.test_graphs import _runner, _tokens

    runner, lens = _runner(dtype=torch.bfloat16, compile_mode="off")
    tokens, step = _tokens(rows, T, seed=4), EagerRunner(runner.model, runner.cache, "cpu")
    monkeypatch.setattr(llama, "fused_norm", lambda t, weight: not torch.is_grad_enabled())
    with torch.inference_mode():
        k0, v0 = runner.cache.k.clone(), runner.cache.v.clone()
        ref, _ = step.run(tokens, lens[:rows])
        runner.cache.k.copy_(k0)
        runner.cache.v.copy_(v0)
        _as_on_cuda(monkeypatch, request)
        calls = []
        monkeypatch.setattr(fused_ops, "_fused_product", lambda *args: calls.append(args) or few_rows.product(*args))
        got, _ = step.run(tokens, lens[:rows])
    layers = runner.model.cfg.num_layers
    kinds = [("gated" if a[6:] and a[6] else "norm" if a[4:] and a[4] is not None else
              "residual" if a[3] is not None else "plain") for a in calls]
    assert kinds.count("norm") == 2 * layers + 1 and kinds.count("residual") == kinds.count("gated") == layers
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
