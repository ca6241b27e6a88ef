"""rollout/runtime/model/attention.py: the dense masks against a brute-force definition, the causal
prefill against a masked one, and the CUDA kernel (FlexAttention with block masks built from per-row
lengths) against the dense reference. FlexAttention runs on CPU under torch.compile (a C++ compiler
is needed), so the equivalence is checked here as well as on a GPU (tests/gpu)."""
import shutil

import pytest
import torch

from rlspec.rollout.runtime.graphs import EagerRunner, build_step_batch, head_group
from rlspec.rollout.runtime.model import attention
from rlspec.rollout.runtime.model.attention import (attend_causal, attend_dense, attend_flex, dense_step_mask, step_mask)
from tests.rollout.runtime.test_graphs import _runner, _tokens, _tree

needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="torch.compile's CPU backend needs a C++ compiler")
H, KV, D = 4, 2, 16  # the tiny test models' heads: these tests share compiled kernels with the model test


def _brute_mask(start, T, S, tree):
    """[B, 1, T, S] by the definition: key j < start visible; j = start + u visible to node i iff tree[i, u]."""
    B = len(start)
    out = torch.zeros(B, 1, T, S, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            for j in range(S):
                u = j - int(start[b])
                out[b, 0, i, j] = u < 0 or (u < T and bool(tree[b, i, u]))
    return out


def _tree_rows(B, T, seed=0):
    """Random trees: node i sees itself and a random subset of earlier nodes, [B, T, T] bool."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(B, T, T, generator=g) < 0.5
    return (low.tril(-1) | torch.eye(T, dtype=torch.bool)).contiguous()


@pytest.mark.parametrize("chain", [True, False])
def test_dense_step_mask_matches_definition(chain):
    start, T, S = torch.tensor([0, 3, 9]), 4, 14
    tree = torch.ones(T, T, dtype=torch.bool).tril().repeat(3, 1, 1) if chain else _tree_rows(3, T)
    got = dense_step_mask(start, T, S, None if chain else tree)
    assert torch.equal(got, _brute_mask(start, T, S, tree))


def test_causal_prefill_equals_masked_attention_for_real_tokens():
    """Right-padded prompts: is_causal (no mask) equals the old mask that also hid padding keys, on every
    real token, on both sides of the CPU's grouped-matmul threshold."""
    g = torch.Generator().manual_seed(0)
    for T in (9, attention.FEW_QUERIES + 8):
        lens = torch.tensor([T, T - 5, 2])
        q = torch.randn(3, H, T, D, generator=g)
        k, v = torch.randn(2, 3, KV, T, D, generator=g)
        pos = torch.arange(T)
        old = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens[:, None, None])
        ref = attend_dense(q, k, v, old[:, None])
        got = attend_causal(q, k, v)
        for b, n in enumerate(lens.tolist()):
            assert torch.allclose(got[b, :, :n], ref[b, :, :n], atol=1e-5, rtol=0)


def _qkv(B, T, S, seed, heads=H, kv=KV):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, heads, T, D, generator=g), torch.randn(B, kv, S, D, generator=g), \
        torch.randn(B, kv, S, D, generator=g)


@needs_compiler
@pytest.mark.parametrize("T,tree,heads,group", [(1, False, H, H // KV), (3, False, H, H // KV), (4, True, H, H // KV),
                                                (4, True, H, 1), (32, True, 8 * KV, 8)])
def test_flex_equals_dense_across_block_boundaries(T, tree, heads, group):
    """Rows whose new tokens start inside a block, at a block boundary, straddle two blocks, or sit in
    the first block; S = 300 is not a multiple of the 128-position block; T = 3 is padded to 4. The model's
    path folds each KV head's query heads into the query axis (group = heads // KV); group 1 is torch's own
    grouped attention; 8 heads a group of 32 tokens fill two 128-query blocks."""
    start = torch.tensor([5, 128, 126, 250, 40])
    S, B = 300, len(start)
    trees = _tree_rows(B, T, seed=T) if tree else None
    q, k, v = _qkv(B, T, S, seed=T, heads=heads)
    ref = attend_dense(q, k, v, dense_step_mask(start, T, S, trees))
    mask = step_mask(start, T, S, trees, flex=True, group=group)
    assert mask.block is not None and mask.dense is None and mask.group == group
    assert mask.block.shape[-2] == group * (1 << (T - 1).bit_length())  # the folded query axis
    got = attend_flex(q, k, v, mask)
    assert attention.flex_error() is None, attention.flex_error()
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()


def test_a_flex_mask_of_another_group_is_refused():
    start = torch.tensor([5, 40])
    q, k, v = _qkv(2, 1, 256, seed=0, heads=3 * KV)
    with pytest.raises(ValueError, match="num_heads // num_kv_heads"):
        attend_flex(q, k, v, step_mask(start, 1, 256, flex=True, group=2))


@needs_compiler
@pytest.mark.parametrize("shape", ["decode", "tree"])
def test_model_step_through_flex_equals_dense(shape):
    """The whole step forward with the flex mask over the full cache (what a CUDA graph replays) equals
    the eager dense step that reads max(start) + T positions: logits and hidden states."""
    runner, lens = _runner(rows=8, length=300, n_prompts=5)
    T = 1 if shape == "decode" else 4
    depths, tree = _tree(5) if shape == "tree" else (None, None)
    tokens = _tokens(5, T, seed=7)
    ref, ref_h = EagerRunner(runner.model, runner.cache, "cpu").run(tokens, lens, depths, tree, hidden_layers=(1,))
    fb = build_step_batch(tokens, lens, runner.cache, runner.cache.length, depths, tree, flex=True,
                          group=head_group(runner.model))
    assert fb.attn.group == 2
    got, got_h = runner.model(fb, runner.cache.k, runner.cache.v, (1,))
    assert attention.flex_error() is None, attention.flex_error()
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
    assert torch.allclose(got_h[1], ref_h[1], atol=1e-5, rtol=0)


def test_cpu_keeps_the_dense_path():
    assert not attention.use_flex("cpu")
    runner, lens = _runner(n_prompts=2)
    fb = build_step_batch(_tokens(2, 1), lens, runner.cache, 64, flex=attention.use_flex("cpu"))
    assert fb.attn.dense is not None and fb.attn.block is None and fb.attn.kv_len == 64


def _paged_runner(n_prompts=5, length=384, device="cpu"):
    """Rows whose 128-position blocks interleave in the pool (row r's block j is physical 1 + j*5 + r),
    prefilled with prompts long enough to span blocks: what the paged FlexAttention path reads."""
    from rlspec.rollout.runtime.kv_cache import PagedKVCache
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.runtime.runner import ModelRunner
    from tests.conftest import make_tiny_hf, random_prompts

    model = loader.from_hf_model(make_tiny_hf("llama"), torch.float32, device)
    runner = ModelRunner(model, device, torch.float32)
    cache = PagedKVCache(model.cfg, n_prompts, length, n_prompts * 3 + 1, BLOCK_, torch.float32, device)
    for j in range(length // BLOCK_):
        cache.grow([(r, r, (j + 1) * BLOCK_) for r in range(n_prompts)])
    runner.cache = cache
    model.init_rope(length)
    prompts = random_prompts(n_prompts, 100, 250, seed=3)
    runner.prefill(prompts, list(range(n_prompts)))
    return runner, torch.tensor([len(p) for p in prompts])


BLOCK_ = attention.BLOCK


@needs_compiler
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-layer"])
@pytest.mark.parametrize("shape", ["decode", "tree"])
def test_paged_flex_reads_the_pool_through_the_block_table(shape, compiled):
    """CUDA's path: FlexAttention over the whole pool with physical block indices (no gather) equals the
    dense attention over each row's gathered blocks; also inside the compiled layer (runtime/compiled.py), where
    the flex call sits behind a graph break (`make gpu-check` found it failing there first, traced into the layer)."""
    from rlspec.rollout.runtime.compiled import compiled_layer_call

    runner, lens = _paged_runner()
    cache = runner.cache
    T = 1 if shape == "decode" else 4
    depths, tree = _tree(5) if shape == "tree" else (None, None)
    tokens = _tokens(5, T, seed=3)
    ref, ref_h = EagerRunner(runner.model, cache, "cpu").run(tokens, lens, depths, tree, hidden_layers=(1,))
    fb = build_step_batch(tokens, lens, cache, cache.length, depths, tree, flex=True, group=head_group(runner.model))
    assert fb.blocks is None and fb.attn.table is not None and fb.attn.block is not None and fb.attn.group == 2
    got, got_h = runner.model(fb, cache.k, cache.v, (1,), layer_call=compiled_layer_call() if compiled else None)
    assert attention.flex_error() is None, attention.flex_error()
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
    assert torch.allclose(got_h[1], ref_h[1], atol=1e-5, rtol=0)


def test_paged_flex_failure_falls_back_to_gathered_dense(monkeypatch):
    runner, lens = _paged_runner()
    cache = runner.cache
    tokens = _tokens(5, 1, seed=4)
    ref, _ = EagerRunner(runner.model, cache, "cpu").run(tokens, lens)
    fb = build_step_batch(tokens, lens, cache, cache.length, flex=True, group=head_group(runner.model))

    def broken():
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(attention, "_flex_error", [])
    monkeypatch.setattr(attention, "_compiled_flex", broken)
    with pytest.warns(RuntimeWarning, match="falls back to dense"):
        got, _ = runner.model(fb, cache.k, cache.v)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)
