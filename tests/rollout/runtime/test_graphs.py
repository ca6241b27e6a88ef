"""rollout/graphs.py: bucket and padding logic, the eager fallback against ModelRunner.step, the pool's
padding/static-buffer path on CPU (emulated replay), and real CUDA graph replay where a GPU exists."""

import pytest
import torch

from rlspec.rollout.runtime.graphs import (EagerRunner, GraphPool, batch_buckets, bucket_for, make_step_runner, pad_batch,
                            pow2_buckets, verify_buckets)
from rlspec.rollout.runtime.kv_cache import PagedKVCache
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.runner import ModelRunner
from tests.conftest import TINY_VOCAB, make_tiny_hf, random_prompts

CUDA = torch.cuda.is_available()


def _runner(rows=8, length=64, n_prompts=5, device="cpu", dtype=torch.float32, compile_mode="auto", **config):
    """A tiny Llama (float32 by default; config: its config fields) with n_prompts prefilled into rows 0..n-1;
    returns (runner, prompt lengths)."""
    model = loader.from_hf_model(make_tiny_hf("llama", **config), dtype, device)
    runner = ModelRunner(model, device, dtype, compile_mode=compile_mode)
    runner.ensure_cache(rows, length).reserve_rows(rows, length)
    prompts = random_prompts(n_prompts, 3, 12, seed=3)
    runner.prefill(prompts, list(range(n_prompts)))
    return runner, torch.tensor([len(p) for p in prompts])


def _tree(B):
    """Rows of the 4-node tree 0 -> {1, 2}, 2 -> 3: depths [B, 4], tree_mask [B, 4, 4]."""
    depths = torch.tensor([[0, 1, 1, 2]]).repeat(B, 1)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    return depths, tree.repeat(B, 1, 1)


def _tokens(B, T, seed=0):
    return torch.randint(3, TINY_VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- pure functions ------------------------------------------------------------------------------
def test_batch_buckets_follow_nano_vllm_and_end_at_max_rows():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]


def test_bucket_for_and_pow2_buckets():
    buckets = batch_buckets(64)
    assert [bucket_for(b, buckets) for b in (1, 3, 5, 9, 17, 33, 64)] == [1, 4, 8, 16, 32, 48, 64]
    assert bucket_for(65, buckets) is None
    assert pow2_buckets(256, 1000) == [256, 512, 1000]
    assert pow2_buckets(256, 256) == [256]
    assert pow2_buckets(1, 16) == [1, 2, 4, 8, 16]


def test_pad_batch_fills_padding_rows_and_nodes_as_chains():
    depths, tree = _tree(2)
    tokens, start = _tokens(2, 4), torch.tensor([7, 9])
    t, s, d, m = pad_batch(tokens, start, depths, tree, rows=4, T=6)
    assert t.shape == (4, 6) and s.tolist() == [7, 9, 0, 0]
    assert torch.equal(t[:2, :4], tokens) and t[2:].eq(0).all() and t[:2, 4:].eq(0).all()
    assert torch.equal(d[:2, :4], depths) and d[2:].tolist() == [list(range(6))] * 2
    assert torch.equal(m[:2, :4, :4], tree)
    chain = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(m[2], chain) and torch.equal(m[3], chain)
    assert not m[:2, :4, 4:].any(), "real nodes must never see padding nodes"
    _, _, d, m = pad_batch(tokens, start, None, None, rows=2, T=4)  # chain: arange depths, tril mask
    assert d.tolist() == [[0, 1, 2, 3]] * 2 and torch.equal(m[0], chain[:4, :4])


# ---- eager fallback and padding on CPU -------------------------------------------------------------
@pytest.mark.parametrize("shape", ["decode", "chain", "tree"])
def test_eager_runner_equals_model_runner_step_exactly(shape):
    runner, lens = _runner()
    eager = EagerRunner(runner.model, runner.cache, "cpu")
    T = {"decode": 1, "chain": 3, "tree": 4}[shape]
    depths, tree = _tree(5) if shape == "tree" else (None, None)
    tokens = _tokens(5, T)
    ref, ref_h = runner.step(tokens, lens, depths, tree, hidden_layers=(0, 1))
    got, got_h = eager.run(tokens, lens, depths, tree, hidden_layers=(0, 1))
    assert torch.equal(got, ref)
    assert all(torch.equal(got_h[i], ref_h[i]) for i in (0, 1))


@pytest.mark.parametrize("tree_rows", [False, True])
def test_padding_rows_and_nodes_do_not_change_real_rows(tree_rows):
    """Pad 3 rows x 4 nodes to 8 rows x 8 nodes and run eagerly: real rows' logits, and every cache
    entry a live row can see, are unchanged; padding writes only dead rows and past live lengths."""
    runner, lens = _runner(n_prompts=3)
    cache, eager = runner.cache, EagerRunner(runner.model, runner.cache, "cpu")
    depths, tree = _tree(3) if tree_rows else (None, None)
    tokens = _tokens(3, 4)
    ref, _ = eager.run(tokens, lens, depths, tree)
    k_ref, v_ref = _rows_view(cache)
    got, _ = eager.run(*pad_batch(tokens, lens, depths, tree, rows=8, T=8))
    assert torch.allclose(got[:3, :4], ref, atol=1e-5, rtol=0)
    k_new, v_new = _rows_view(cache)
    for row, n in enumerate(lens.tolist()):  # live rows: context untouched, own writes equal up to rounding
        for new, old in ((k_new, k_ref), (v_new, v_ref)):
            assert torch.equal(new[:, row, :, :n], old[:, row, :, :n])
            assert torch.allclose(new[:, row, :, n : n + 4], old[:, row, :, n : n + 4], atol=1e-5, rtol=0)
    assert torch.equal(k_new[:, 3:, :, 8:], k_ref[:, 3:, :, 8:]), "dead rows: only positions 0..T-1 written"


def _rows_view(cache):
    """Every row's positions as contiguous copies: (k, v) [layers, rows, KV, length, D]."""
    rows = torch.arange(cache.rows)
    kv = [cache.gather(layer, rows, cache.length) for layer in range(cache.layers)]
    return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])


# ---- the pool's static-buffer path on CPU (emulated replay) -------------------------------------------
def _emulated_pool(runner, **kw):
    return GraphPool(runner.model, runner.cache, "cpu", backend="emulate", max_t=8, **kw)


def test_verify_graphs_exist_for_the_token_counts_the_arms_use():
    """A verify of 4 drafts runs a 5-token graph, not an 8 (the powers of two stay for capped drafts): the sizes
    come through ModelRunner.warm, which the engine's calibration calls with the selector's verify sizes."""
    assert verify_buckets(8) == [1, 2, 4, 8]
    assert verify_buckets(8, [1, 3, 5, 9]) == [1, 2, 3, 4, 5, 8]  # 9 is past the pool's largest step
    runner, lens = _runner()
    runner.steps = pool = _emulated_pool(runner)
    assert pool.key_for(_tokens(3, 5), lens[:3])[:2] == (4, 8)
    runner.warm([1, 5], 3)
    assert pool.t_buckets == [1, 2, 4, 5, 8]
    assert pool.key_for(_tokens(3, 5), lens[:3])[:2] == (4, 5)
    assert pool.key_for(_tokens(3, 3), lens[:3])[:2] == (4, 4)  # a capped draft: the next bucket up
    eager = EagerRunner(runner.model, runner.cache, "cpu")
    tokens = _tokens(3, 5, seed=1)
    got, _ = pool.run(tokens, lens[:3])
    assert (4, 5, ()) in pool.graphs and torch.allclose(got, eager.run(tokens, lens[:3])[0], atol=1e-5, rtol=0)


def test_emulated_pool_matches_eager_across_buckets_and_shapes():
    runner, lens = _runner()
    eager = EagerRunner(runner.model, runner.cache, "cpu")
    pool = _emulated_pool(runner)
    # batch 5 -> bucket 8, then 3 -> 4, 1 -> 1; T 1, 3 (-> 4), tree 4, then a chain at the tree's key (its
    # depths and mask written again): buffers are reused across keys
    for B in (5, 3, 1):
        for T, tree_rows in ((1, False), (3, False), (4, True), (4, False)):
            depths, tree = _tree(B) if tree_rows else (None, None)
            tokens = _tokens(B, T, seed=B * 10 + T)
            ref, ref_h = eager.run(tokens, lens[:B], depths, tree, hidden_layers=(1,))
            got, got_h = pool.run(tokens, lens[:B], depths, tree, hidden_layers=(1,))
            assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5, rtol=0)
            assert torch.allclose(got_h[1], ref_h[1], atol=1e-5, rtol=0)
    assert pool.counts == {"replays": 12, "captures": 6, "eager": 0}  # T=3 and T=4 share the t=4 graphs
    pool.run(_tokens(3, 1), lens[:3])  # same bucket, no hidden layers: a new key
    pool.run(_tokens(3, 1, seed=9), lens[:3])  # ... replayed, not recaptured
    assert pool.counts["captures"] == 7 and pool.counts["replays"] == 14


def test_padding_rows_start_at_zero_whatever_the_buffers_held():
    """A chain step copies only its own rows into the graph's buffers: the padding rows' starts must not keep a
    larger batch's (a stale start near the cache's end runs positions past it: RoPE rows and block-table entries
    that do not exist)."""
    runner, lens = _runner(rows=8, length=64, n_prompts=8)
    eager = EagerRunner(runner.model, runner.cache, "cpu")
    pool = _emulated_pool(runner)
    pool.run(_tokens(8, 1), torch.full((8,), runner.cache.length - 1))  # rows 0..7 at the cache's last position
    runner.cache.clear_rows(3)  # as the engine does: rows 3.. are padding now
    tokens = _tokens(3, 4, seed=5)
    got, _ = pool.run(tokens, lens[:3])  # bucket (4, 4): padding row 3 would start at 63 and run to 66
    assert torch.allclose(got, eager.run(tokens, lens[:3])[0], atol=1e-5, rtol=0)


def test_emulated_pool_greedy_decode_with_shrinking_batch_matches_eager():
    """An engine-like loop: decode greedily, retiring a row every few steps and compacting the rest
    downwards, so rows once used as padding come back as live rows. Tokens must match eager's."""
    outs = []
    for use_pool in (False, True):
        runner, lens = _runner(rows=8, length=64, n_prompts=6)
        step = _emulated_pool(runner).run if use_pool else EagerRunner(runner.model, runner.cache, "cpu").run
        lens, tok, emitted = lens.clone(), torch.full((6, 1), 5), []
        for i in range(24):
            logits, _ = step(tok, lens)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            emitted.append(tok[:, 0].tolist())
            lens += 1
            if i % 5 == 4 and len(lens) > 1:  # retire row 0: move the others' block tables down one row
                runner.cache.move_rows(list(range(1, len(lens))), list(range(len(lens) - 1)))
                runner.cache.clear_rows(len(lens) - 1)  # as the engine does: padding rows must write trash
                lens, tok = lens[1:], tok[1:]
        outs.append(emitted)
    assert outs[0] == outs[1]


# FlexAttention behind its graph break is made as Dynamo traces, not through a cache Dynamo would trace past (and warn)
@pytest.mark.filterwarnings("error:Dynamo detected a call:UserWarning")
def test_compiled_layer_graphs_serve_every_pool_size(monkeypatch, dynamo_only):
    """CUDA's pairing emulated on the CPU: captured graphs of the compiled layer, attending through FlexAttention
    over the paged pool. Over pools of three sizes (the engine re-sizes its pool between rollouts) the layer's
    graphs compile for the first and serve the others (FlexAttention, kept outside them, recompiles on its own),
    and every step equals the eager dense one. The graphs' count is the subject, so dynamo builds them without
    inductor's code (dynamo_only); compiled FlexAttention over the pool: test_attention.py."""
    import torch._dynamo.eval_frame as eval_frame

    from rlspec.rollout.runtime import graphs
    from rlspec.rollout.runtime.compiled import captured_layer_call, compiled_layer_call
    from rlspec.rollout.runtime.model import attention

    monkeypatch.setattr(graphs, "use_flex", lambda device: True)
    model = loader.from_hf_model(make_tiny_hf("llama", seed=4), torch.float32, "cpu")
    layer_code = compiled_layer_call()._torchdynamo_orig_callable.__code__
    graphs_after = []
    try:
        for blocks in (9, 13, 17):  # 128-position blocks, FlexAttention's
            cache = PagedKVCache(model.cfg, 1, 512, blocks, 128, torch.float32, "cpu")
            cache.reserve_rows(1, 300)
            cache.k.normal_(generator=torch.Generator().manual_seed(blocks))  # a context of 200 cached positions
            cache.v.normal_(generator=torch.Generator().manual_seed(blocks + 1))
            model.init_rope(cache.length)
            pool = GraphPool(model, cache, "cpu", backend="emulate", layer_call=captured_layer_call(), max_t=4)
            tokens, start = _tokens(1, 1, seed=blocks), torch.tensor([200])
            ref = EagerRunner(model, cache, "cpu").run(tokens, start)[0]
            got = pool.run(tokens, start)[0]
            assert pool.counts["captures"] == 1
            assert attention.flex_error() is None, attention.flex_error()  # flex ran, not its dense fallback
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
            graphs_after.append(len(eval_frame._debug_get_cache_entry_list(layer_code)))
    finally:
        # dynamo's frame state outlives the test: flex, having met three pool sizes, would next compile with a
        # dynamic KV length, which torch's C++ (CPU) flex template cannot build (CUDA's can); later tests start
        # afresh
        torch._dynamo.reset()
    assert graphs_after[1:] == graphs_after[:1] * 2, graphs_after  # pools of other sizes: no new layer graph


def test_pool_falls_back_to_eager_outside_its_buckets():
    runner, lens = _runner(rows=4, length=64, n_prompts=4)
    pool = _emulated_pool(runner, max_rows=2)
    pool.run(_tokens(3, 1), lens[:3])  # batch above the largest bucket
    pool.run(_tokens(1, 9), lens[:1])  # T above max_t
    pool.run(_tokens(1, 5), torch.tensor([58]))  # T 5 fits, its bucket 8 would write past position 63
    assert pool.counts == {"replays": 0, "captures": 0, "eager": 3}


def test_eager_start_captures_every_bucket_largest_first():
    runner, _ = _runner(rows=4, length=32, n_prompts=1)
    pool = GraphPool(runner.model, runner.cache, "cpu", "eager_start", max_t=2, backend="emulate")
    assert pool.batch_buckets == [1, 2, 4] and pool.t_buckets == [1, 2]
    keys = list(pool.graphs)
    assert len(keys) == 3 * 2 and keys[0] == (4, 2, ())
    assert pool.memory_bytes() == pool.static.nbytes() > 0


def test_stale_pool_refuses_to_replay_after_cache_reallocation():
    runner, lens = _runner(rows=4, length=32, n_prompts=2)
    pool = _emulated_pool(runner)
    runner.ensure_cache(4, 48)  # grows: new cache and new RoPE tables
    with pytest.raises(RuntimeError, match="reallocated"):
        pool.run(_tokens(2, 1), lens)


def test_make_step_runner_is_eager_on_cpu_and_checks_mode():
    runner, _ = _runner(n_prompts=1)
    for mode in ("auto", "off", "lazy", "eager_start"):
        assert isinstance(make_step_runner(runner.model, runner.cache, "cpu", mode), EagerRunner)
    with pytest.raises(ValueError, match="graph mode"):
        make_step_runner(runner.model, runner.cache, "cpu", "always")
    with pytest.raises(ValueError, match="CUDA graphs need"):
        GraphPool(runner.model, runner.cache, "cpu")


# ---- real CUDA graphs ---------------------------------------------------------------------------
def needs_cuda(test):
    """Marked gpu (so `make gpu-check` selects it) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")(test))


def _cuda_setup(rows=32, length=128):
    """Tiny float32 Llama on the GPU with a random-filled cache (context values only need to be equal)."""
    model = loader.from_hf_model(make_tiny_hf("llama"), torch.float32, "cuda")
    cache = PagedKVCache.for_rows(model.cfg, rows, length, torch.float32, "cuda", block_size=128)  # flex blocks
    model.init_rope(length)
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    return model, cache


@needs_cuda
@pytest.mark.parametrize("shape", ["decode", "chain", "tree"])
def test_cuda_graph_replay_equals_eager(shape):
    """Batches of 1, 3 and 17 rows, each with a model, cache and pool of its own (one test per shape: on a CPU
    machine each id is a skip, and the suite's count of skips stays small)."""
    for B in (1, 3, 17):
        _graph_replay_equals_eager(B, shape)


def _graph_replay_equals_eager(B: int, shape: str) -> None:
    model, cache = _cuda_setup()
    eager, pool = EagerRunner(model, cache, "cuda"), GraphPool(model, cache, "cuda", max_t=8)
    T = {"decode": 1, "chain": 5, "tree": 4}[shape]
    depths, tree = _tree(B) if shape == "tree" else (None, None)
    for step in range(3):  # first call captures, later ones replay with new inputs
        start = torch.randint(4, 40, (B,), generator=torch.Generator().manual_seed(step))
        tokens = _tokens(B, T, seed=step)
        ref, ref_h = eager.run(tokens, start, depths, tree, hidden_layers=(0, 1))
        got, got_h = pool.run(tokens, start, depths, tree, hidden_layers=(0, 1))
        assert torch.allclose(got, ref, atol=1e-4, rtol=0), (B, (got - ref).abs().max())
        assert all(torch.allclose(got_h[i], ref_h[i], atol=1e-4, rtol=0) for i in (0, 1)), B
    assert pool.counts["eager"] == 0 and pool.counts["replays"] == 3, (B, pool.counts)


@needs_cuda
def test_cuda_pool_memory_is_reported():
    model, cache = _cuda_setup()
    pool = GraphPool(model, cache, "cuda", "eager_start", max_t=2)
    assert len(pool.graphs) == len(pool.batch_buckets) * 2
    assert pool.memory_bytes() >= pool.static.nbytes() > 0
    print(f"pool: {len(pool.graphs)} graphs, {pool.memory_bytes() / 2**20:.1f} MiB "
          f"(static {pool.static.nbytes() / 2**20:.1f} MiB)")


def test_engine_constructors_pass_graph_mode_and_reject_unknown_ones():
    from rlspec.rollout.engine import RolloutEngine

    engine = RolloutEngine.from_hf_model(make_tiny_hf("llama"), None, graph_mode="eager_start", max_num_seqs=2)
    assert engine.runner.graph_mode == "eager_start"
    with pytest.raises(ValueError, match="graph_mode must be one of"):
        RolloutEngine.from_hf_model(make_tiny_hf("llama"), None, graph_mode="always")
