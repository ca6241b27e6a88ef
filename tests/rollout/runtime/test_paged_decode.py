"""The Triton paged decode attention (model/paged_decode.py) against the dense reference (attention.attend_dense
over the rows' gathered blocks, float64). On CUDA it runs compiled; elsewhere through Triton's interpreter
(TRITON_INTERPRET, tests/conftest.py), the same kernels on CPU tensors.

The pools hold NaN everywhere but the rows' live positions (start + T each), and the physical blocks are
shuffled across rows: a kernel that read a key past a row's live length, or through the wrong block, returns NaN
or another row's attention. Starts sit inside, at and across block and tile edges; queries fold G heads per KV
head (G = 7 is Qwen2.5-7B's, not a power of two), a verify's tokens under a tree or a chain, more queries than
one program holds (two query tiles), a head size that is not a power of two, and the context split into one
chunk (the final output written directly) or into more chunks than most rows have tiles (empty chunks merged)."""
from __future__ import annotations

import os

import pytest
import torch

from rlspec.rollout.runtime.kv_cache import gather_blocks
from rlspec.rollout.runtime.model.attention import attend_dense, dense_step_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before triton is imported)", allow_module_level=True)
paged_decode = pytest.importorskip("rlspec.rollout.runtime.model.paged_decode", reason="needs triton")
import triton  # noqa: E402  (after the skip: paged_decode imported it)

BS = 64  # the pool's block size: one tile of keys a block (128 on CUDA, two tiles: the CUDA tests' shapes)


def _case(B, H, KV, D, T, starts, dtype, tree: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = max(-(-(s + T) // BS) for s in starts)
    blocks = B * n + 3
    table = torch.randperm(blocks, generator=g)[: B * n].view(B, n)  # physical blocks shuffled across rows
    k_pool, v_pool = torch.full((2, blocks, BS, KV, D), float("nan"), dtype=torch.float64)
    for b, s in enumerate(starts):
        for p in range(s + T):
            k_pool[table[b, p // BS], p % BS] = torch.randn(KV, D, generator=g, dtype=torch.float64)
            v_pool[table[b, p // BS], p % BS] = torch.randn(KV, D, generator=g, dtype=torch.float64)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    trees = ((torch.rand(B, T, T, generator=g) < 0.5).tril(-1) | torch.eye(T, dtype=torch.bool)) if tree else None
    start = torch.tensor(starts)
    # the reference sees only live positions (the mask); zeros where the pools hold NaN keep 0 * NaN out of it
    k, v = (gather_blocks(x.nan_to_num(0.0), table) for x in (k_pool, v_pool))
    ref = attend_dense(q, k, v, dense_step_mask(start, T, n * BS, trees))
    dev = torch.device(DEVICE)
    args = (q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), table, start, trees)
    return [None if x is None else x.to(dev) for x in args], ref


# (heads, kv heads, head dim, T, tree, dtype)
CASES = [
    (4, 2, 32, 1, False, torch.float32),  # plain decode
    (28, 4, 128, 1, False, torch.float32),  # Qwen2.5-7B's heads: 7 per KV head
    (8, 2, 32, 5, True, torch.float32),  # a tree verify
    (6, 6, 32, 3, False, torch.float32),  # a chain verify, no grouping
    (7, 1, 48, 10, True, torch.float32),  # 70 queries a KV head: two query tiles; head size 48 padded to 64
    (9, 3, 64, 4, True, torch.bfloat16),  # SmolLM2's heads in bf16
]
STARTS = [5, 63, 64, 130, 200]  # inside, at and across the edges of 64-position blocks


@pytest.mark.parametrize("H,KV,D,T,tree,dtype", CASES)
@pytest.mark.parametrize("programs", [1, 4096])
def test_paged_decode_is_the_dense_reference(monkeypatch, H, KV, D, T, tree, dtype, programs):
    """programs: how many programs the device wants: 1 gives one chunk per (row, KV head, query tile), the output
    written directly; 4096 more chunks than most rows have tiles, merged by their log-sum-exps."""
    monkeypatch.setattr(paged_decode, "_programs_wanted", lambda device, per_sm: programs)
    args, ref = _case(len(STARTS), H, KV, D, T, STARTS, dtype, tree)
    positions = args[3].shape[1] * BS
    M = max(16, min(triton.next_power_of_2(H // KV * T), paged_decode.MAX_ROWS))
    keys = paged_decode.tile_keys(M, triton.next_power_of_2(D), dtype.itemsize, BS)
    splits = paged_decode.splits(len(STARTS), KV, positions, torch.device(DEVICE), keys)
    assert splits == (1 if programs == 1 else positions // keys)  # a chunk a tile: some empty
    got = paged_decode.paged_decode(*args)
    assert got.shape == ref.shape and got.dtype == dtype and got.transpose(1, 2).is_contiguous()
    atol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double().cpu(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("programs", [1, 40])
@pytest.mark.parametrize("H,KV,D,T,tree,dtype", [CASES[1], CASES[2]])
def test_tiles_smaller_than_a_block(monkeypatch, H, KV, D, T, tree, dtype, programs):
    """Tiles of 16 keys, four to a pool block: each tile's block is read a tile ahead and carried across the tiles
    of one block and into the next; 40 programs give chunks of several tiles that start inside blocks."""
    monkeypatch.setattr(paged_decode, "_programs_wanted", lambda device, per_sm: programs)
    args, ref = _case(len(STARTS), H, KV, D, T, STARTS, dtype, tree, seed=1)
    got = paged_decode.paged_decode(*args, keys=16)
    torch.testing.assert_close(got.double().cpu(), ref, atol=2e-5, rtol=0)


def test_scale_and_bad_shapes():
    """A model's own score scale (Gemma's query_pre_attn_scalar) is the one applied; shapes the kernel cannot
    serve are refused with what they need."""
    args, _ = _case(2, 4, 2, 32, 1, [10, 70], torch.float32, False)
    q, k_pool, v_pool, table, start, _ = args
    k, v = (gather_blocks(x.nan_to_num(0.0), table) for x in (k_pool, v_pool))
    ref = attend_dense(q, k, v, dense_step_mask(start, 1, table.shape[1] * BS, None), scale=0.3)
    torch.testing.assert_close(paged_decode.paged_decode(q, k_pool, v_pool, table, start, None, 0.3), ref,
                               atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        paged_decode.paged_decode(q[:, :3], k_pool, v_pool, table, start, None)


def test_start_and_table_read_through_their_strides():
    """A step's start as the engine may hand it, a column of the host's packed transfer (stride 2), and a table whose
    entries are not side by side: the same output as from contiguous ones (read as contiguous, every row but the
    first took another row's length)."""
    args, ref = _case(len(STARTS), 4, 2, 32, 1, STARTS, torch.float32, False)
    q, k_pool, v_pool, table, start, tree = args
    start = torch.stack([torch.zeros_like(start), start], 1)[:, 1]
    table = torch.stack([table, table], 2)[..., 0]
    assert start.stride(0) == 2 and table.stride(1) == 2
    got = paged_decode.paged_decode(q, k_pool, v_pool, table, start, tree)
    torch.testing.assert_close(got.double().cpu(), ref, atol=2e-5, rtol=0)


def test_an_eager_engine_through_the_kernel_is_greedy_transformers(monkeypatch):
    """The CUDA engine's eager path (graph_mode off, or a shape no graph holds): FlexAttention's layout and the paged
    kernel for every step, on CPU tensors through the interpreter; greedy rollouts of six prompts equal transformers'
    generate token for token, and the kernel attended."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime import graphs
    from rlspec.rollout.runtime.model import attention, llama, loader
    from rlspec.rollout.types import SamplingParams
    from tests.conftest import make_tiny_hf, random_prompts

    calls = []
    monkeypatch.setattr(attention, "use_paged_decode", lambda device: True)
    monkeypatch.setattr(graphs, "use_flex", lambda device: True)
    monkeypatch.setattr(llama, "attend_paged", lambda *a: calls.append(1) or attention.attend_paged(*a))
    hf = make_tiny_hf("llama")
    prompts = random_prompts(6, 2, 25, seed=3)
    engine = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], graph_mode="off", kv_block_size=128)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=2,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert out.completion_ids == (ids[: ids.index(2) + 1] if 2 in ids else ids)
    assert calls and not attention._paged_error


# ---- in the model: llama.Attention's paged branch --------------------------------------------------------------
def _paged_step(monkeypatch, T):
    from rlspec.rollout.runtime.graphs import EagerRunner, build_step_batch, head_group
    from rlspec.rollout.runtime.model import attention
    from tests.rollout.runtime.test_attention import _paged_runner, _tokens, _tree

    assert not attention._paged_error  # the process's record of the kernel's failures: none so far
    monkeypatch.setattr(attention, "use_paged_decode", lambda device: not attention._paged_error)
    runner, lens = _paged_runner()
    cache = runner.cache
    depths, tree = _tree(5) if T > 1 else (None, None)
    tokens = _tokens(5, T, seed=3)
    ref, ref_h = EagerRunner(runner.model, cache, "cpu").run(tokens, lens, depths, tree, hidden_layers=(1,))
    fb = build_step_batch(tokens, lens, cache, cache.length, depths, tree, flex=True, group=head_group(runner.model))
    return runner, fb, ref, ref_h[1]


@pytest.mark.parametrize("T", [1, 4], ids=["decode", "tree"])
def test_a_model_step_through_the_kernel_equals_the_dense_step(monkeypatch, T):
    """CUDA's paged step: the kernel over the pool (rows' blocks interleaved) through the mask's table, start and
    tree, no BlockMask built, equals the dense step over each row's gathered blocks: logits and hidden states. (In
    a compiled layer it sits behind a graph break as FlexAttention does: `python -m rlspec.bench.gpu --sections
    compiled` runs it there on CUDA.)"""
    from rlspec.rollout.runtime.model import attention

    runner, fb, ref, ref_h = _paged_step(monkeypatch, T)
    assert fb.attn.paged and fb.attn.block is None and fb.blocks is None and fb.attn.table is not None
    got, got_h = runner.model(fb, runner.cache.k, runner.cache.v, (1,))
    assert not attention._paged_error, attention._paged_error
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_h[1], ref_h, atol=1e-5, rtol=0)


def test_a_failing_kernel_falls_back_to_dense_and_then_to_flex_masks(monkeypatch, request):
    """A kernel that cannot compile here: the step warns and attends densely over the gathered blocks (the same
    logits), and the next step's mask is a FlexAttention one."""
    from rlspec.rollout.runtime.graphs import build_step_batch, head_group
    from rlspec.rollout.runtime.model import attention

    runner, fb, ref, _ = _paged_step(monkeypatch, 1)

    def broken(*args):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(attention, "_paged_decode", lambda: broken)
    request.addfinalizer(attention._paged_error.clear)  # the process's record, empty again for the tests after
    with pytest.warns(RuntimeWarning, match="paged steps attend through FlexAttention"):
        got, _ = runner.model(fb, runner.cache.k, runner.cache.v)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    again = build_step_batch(fb.input_ids, fb.attn.start, runner.cache, runner.cache.length, flex=True,
                             group=head_group(runner.model))
    assert not again.attn.paged and again.attn.block is not None
