"""Across rollouts the CUDA graphs survive the policy update: a pool with graphs over it is kept between rollouts
while it takes at most keep_kv_fraction of the device's memory, so captures per rollout fall to 0 (runner.py,
docs/runtime.md#graphs-across-rollouts); and a growing pool keeps the steps' reserve free (kv_budget.py,
docs/runtime.md#memory-plan). The graph pool is CPU-emulated (graphs.GraphPool, backend "emulate")."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime import kv_budget, runner as runner_mod
from rlspec.rollout.runtime.graphs import GraphPool
from rlspec.rollout.runtime.kv_budget import DEFAULT_FRACTION, KVBudget, step_reserve_bytes
from rlspec.rollout.runtime.kv_cache import block_bytes
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.test_engine_ar import hf_greedy

PARAMS = SamplingParams(temperature=0, max_new_tokens=12, n=2)


@pytest.fixture
def emulated_graphs(monkeypatch):
    """The runner builds CPU-emulated graph pools (as make_step_runner builds CUDA ones); returns them all."""
    pools = []

    def make(model, cache, device, mode="auto", layer_call=None, **kw):
        pools.append(GraphPool(model, cache, device, backend="emulate", layer_call=layer_call, **kw))
        return pools[-1]

    monkeypatch.setattr(runner_mod, "make_step_runner", make)
    return pools


def _captures_per_rollout(eng, pools, prompts, rollouts=4):
    out, before = [], 0
    for _ in range(rollouts):
        got = eng.generate(prompts, PARAMS)
        total = sum(p.counts["captures"] for p in pools)
        out.append(total - before)
        before = total
    return out, got


def _engine(hf, **kw):
    return RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], free_kv_between_rollouts=True, **kw)


def test_released_between_rollouts_the_graphs_are_captured_once(emulated_graphs):
    hf = make_tiny_hf("llama", seed=6)
    prompts = random_prompts(3, 4, 9, seed=6)
    eng = _engine(hf)
    captures, got = _captures_per_rollout(eng, emulated_graphs, prompts)
    # dropped with the pool at each release, every rollout captured its buckets again: [n, n, n, n]
    assert captures[0] > 0 and captures[2:] == [0, 0], captures
    assert eng.runner.kept_bytes >= eng.runner.cache.nbytes() > 0  # what the policy update goes without
    ref = [hf_greedy(hf, p, PARAMS.max_new_tokens, 2) for p in prompts for _ in range(PARAMS.n)]
    assert [r.completion_ids for r in got] == ref  # replays over the kept pool still sample the target
    # RoPE tables grown between rollouts (a drafter trainer's window, a non-finite probe): the kept pool's graphs,
    # which hold the old tables' addresses, are captured again rather than refused
    eng.model.init_rope(2 * eng.runner.cache.length)
    assert [r.completion_ids for r in eng.generate(prompts, PARAMS)] == ref


def test_a_pool_above_the_keep_fraction_or_an_explicit_release_is_given_back(emulated_graphs):
    hf = make_tiny_hf("llama", seed=6)
    prompts = random_prompts(3, 4, 9, seed=6)
    eng = _engine(hf)
    eng.runner.keep_kv_fraction = 0.0  # the setting's off switch: every rollout frees, and captures again
    captures, _ = _captures_per_rollout(eng, emulated_graphs, prompts, rollouts=2)
    assert captures[1] == captures[0] > 0 and eng.runner.cache is None and eng.runner.kept_bytes == 0
    eng.runner.keep_kv_fraction = 1.0
    eng.generate(prompts, PARAMS)
    assert eng.runner.cache is not None
    eng.release_kv()  # an explicit release (or a pool holding non-finite values) always gives it back
    assert eng.runner.cache is None and eng.runner.kept_bytes == 0


def _config() -> ModelConfig:
    """SmolLM2-135M's shape (no weights are made)."""
    return ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=2048,
                       tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)


def test_step_reserve_counts_graph_and_verify_buffers():
    cfg = _config()
    got = step_reserve_bytes(cfg, rows=64, max_t=5, dtype=torch.bfloat16, hidden_layers=0)
    logits = 64 * 5 * 49152 * 4  # one [B, K+1, V] float32 tensor: 63 MB
    assert got == logits * (2 + kv_budget.VERIFY_COPIES) + 64 * 5 * (2 * 1536 + 4 * 576) * 2


def test_a_growing_pool_leaves_the_reserve_free(monkeypatch):
    free = 2 * 2**30
    monkeypatch.setattr(kv_budget, "memory_limits", lambda device: {"free device memory": free})
    cfg = _config()
    bb = block_bytes(cfg, cfg.num_layers, 128, torch.bfloat16)
    reserve = step_reserve_bytes(cfg, 64, 5, torch.bfloat16)
    budget = KVBudget(block_size=128)
    size = budget.pool_size(bb, rows=64, length=1 << 16, min_positions=128, device="cuda", reserve_bytes=reserve)
    # without the reserve the ceiling took DEFAULT_FRACTION of free memory for KV alone
    assert (size.max_blocks - 1) * bb + reserve <= DEFAULT_FRACTION * free
    assert (size.max_blocks - 1) * bb > DEFAULT_FRACTION * free - reserve - bb
    assert budget.ceiling_headroom("cuda", reserve)() == int(DEFAULT_FRACTION * free) - reserve


def test_the_runner_reserves_on_cuda_only():
    model = loader.from_hf_model(make_tiny_hf("llama"), torch.float32, "cpu")
    runner = runner_mod.ModelRunner(model, "cpu", torch.float32)
    runner.reserves["drafter"] = 10**9
    assert runner.reserve_bytes(64) == 0  # host memory: the CPU's limits are the budget's own
    runner.device = torch.device("cuda")  # the arithmetic only (no CUDA call)
    assert runner.reserve_bytes(64) == step_reserve_bytes(model.cfg, 64, runner.max_graph_t, torch.float32) + 10**9
