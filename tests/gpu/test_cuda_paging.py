"""The paged KV cache on CUDA: FlexAttention reads the pool through the block table (no gather) and
equals the dense reference; the engine with CUDA graphs and a pool forced to preempt equals
transformers' greedy generate; released after each rollout by default, a pool this small is kept with its
graphs (runner.release)."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.graphs import EagerRunner, GraphPool, build_step_batch, head_group
from rlspec.rollout.runtime.model import attention, loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.runtime.test_attention import _paged_runner
from tests.gpu.test_cuda_engine import _hf_greedy
from tests.rollout.runtime.test_graphs import _tokens, _tree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape", ["decode", "tree"])
def test_paged_flex_equals_gathered_dense_eager_and_in_graphs(shape):
    runner, lens = _paged_runner(device="cuda")
    cache, model = runner.cache, runner.model
    T = 1 if shape == "decode" else 4
    depths, tree = _tree(5) if shape == "tree" else (None, None)
    tokens = _tokens(5, T, seed=3)
    dense = EagerRunner(model, cache, "cuda")
    dense.flex = False  # the reference: each row's blocks gathered, dense masks
    ref, _ = dense.run(tokens, lens, depths, tree)
    fb = build_step_batch(tokens.cuda(), lens.cuda(), cache, cache.length, None if depths is None else depths.cuda(),
                          None if tree is None else tree.cuda(), flex=True, group=head_group(model))
    assert fb.attn.group == model.cfg.num_heads // model.cfg.num_kv_heads
    assert fb.blocks is None and fb.attn.table is not None  # the paged kernel, no gather
    got, _ = model(fb, cache.k, cache.v)
    assert attention.flex_error() is None, attention.flex_error()
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
    pool = GraphPool(model, cache, "cuda", max_t=4)
    for _ in range(2):  # capture, then replay
        got, _ = pool.run(tokens, lens, depths, tree)
        assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
    assert pool.counts["replays"] == 2


@pytest.mark.parametrize("spec,blocks", [(None, 3), (SpecConfig(drafter="eagle3", num_draft_tokens=3, tree_width=2,
                                                              selector="always", online_training=False), 6)],
                         ids=["plain", "eagle3"])
def test_greedy_with_graphs_under_forced_preemption_equals_transformers(spec, blocks):
    """Every sequence outgrows one 128-position block. Admission keeps a block of headroom per live
    sequence, so plain decoding runs one group (2 samples) at a time: 3 blocks force a preemption where 6
    never do (as on a CPU with kv_block_size=128); EAGLE-3's side buffers make its blocks larger."""
    hf = make_tiny_hf("llama", seed=2).cuda()
    prompts = random_prompts(8, 2, 60, seed=3)
    layers = 2 + (spec is not None)
    block = 2 * layers * 128 * 2 * 16 * 4  # 128-position blocks on CUDA, 2 KV heads x 16, float32
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2],
                        kv_memory_gb=blocks * block / 2**30)
    got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=150, n=2))
    stats = eng.stats()
    assert stats["rollout/preemptions"] > 0
    # free_kv_between_rollouts is on by default on CUDA; a pool this small is kept with its graphs (runner.release)
    assert eng.free_kv_between_rollouts and eng.runner.kept_bytes > 0 and eng.runner.cache is not None
    assert attention.flex_error() is None, attention.flex_error()
    assert [r.completion_ids for r in got] == [_hf_greedy(hf, p, 150) for p in prompts for _ in range(2)]
