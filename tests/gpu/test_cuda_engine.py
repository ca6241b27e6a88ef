"""The engine on CUDA: graph replay equals eager at any context length with one graph per (batch, T)
bucket; lazy captures neither synchronise nor empty the cache; greedy equals transformers' generate
(graphs on and off, with and without speculation) and the CPU engine; seeded sampling has the
target's law; the EAGLE-3 drafter trains on the GPU, also in its thread beside a rollout."""
import time

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.graphs import EagerRunner, GraphPool
from rlspec.rollout.runtime.kv_cache import PagedKVCache
from rlspec.rollout.runtime.model import attention, loader
from rlspec.rollout.types import SamplingParams
from tests.conftest import TINY_VOCAB, make_tiny_hf, random_prompts
from tests.rollout.runtime.test_graphs import _cuda_setup, _tokens, _tree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model_and_cache(rows=32, length=512):
    return _cuda_setup(rows, length)


@pytest.mark.parametrize("shape", ["decode", "chain", "tree"])
def test_compiled_graph_replay_equals_eager(shape):
    """Issue 27: the graph pool capturing the compiled layer (runtime/compiled.py) gives the dense eager logits."""
    from rlspec.rollout.runtime.compiled import compiled_layer_call

    model, cache = _model_and_cache()
    pool = GraphPool(model, cache, "cuda", max_t=8, layer_call=compiled_layer_call())
    dense_eager = EagerRunner(model, cache, "cuda")
    dense_eager.flex = False
    T = {"decode": 1, "chain": 5, "tree": 4}[shape]
    for B in (1, 3, 17):
        depths, tree = _tree(B) if shape == "tree" else (None, None)
        for ctx in (5, 130, 500):
            start = torch.full((B,), ctx) - torch.arange(B) % 3
            tokens = _tokens(B, T, seed=ctx)
            ref = dense_eager.run(tokens, start, depths, tree)[0]
            got = pool.run(tokens, start, depths, tree)[0]
            assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
    assert pool.counts["replays"] > 0 and pool.counts["eager"] == 0


def test_compiled_engine_greedy_matches_transformers_on_cuda():
    hf = make_tiny_hf("llama").cuda()
    prompts = random_prompts(6, 2, 25, seed=3)
    eng = RolloutEngine(loader.from_hf_model(hf, torch.float32, "cuda"), None, eos_token_ids=[2], compile_mode="on")
    got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24))
    for r, p in zip(got, prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False, eos_token_id=2,
                              pad_token_id=0)[0, len(p):].tolist()
        assert r.completion_ids == (out[: out.index(2) + 1] if 2 in out else out)


@pytest.mark.parametrize("shape", ["decode", "chain", "tree"])
def test_graph_replay_equals_eager_at_any_context_length(shape):
    model, cache = _model_and_cache()
    pool, flex_eager = GraphPool(model, cache, "cuda", max_t=8), EagerRunner(model, cache, "cuda")
    dense_eager = EagerRunner(model, cache, "cuda")
    dense_eager.flex = False  # the reference: dense masks over max(start) + T positions
    T = {"decode": 1, "chain": 5, "tree": 4}[shape]
    for B in (1, 3, 17):
        depths, tree = _tree(B) if shape == "tree" else (None, None)
        for ctx in (5, 127, 128, 300, 500):  # across 128-position blocks, up to the cache's end
            start = torch.full((B,), ctx) - torch.arange(B) % 3  # ragged rows
            tokens = _tokens(B, T, seed=ctx)
            ref, ref_h = dense_eager.run(tokens, start, depths, tree, hidden_layers=(1,))
            for runner in (flex_eager, pool):
                got, got_h = runner.run(tokens, start, depths, tree, hidden_layers=(1,))
                assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
                assert torch.allclose(got_h[1], ref_h[1], atol=1e-4, rtol=0)
    assert attention.flex_error() is None, attention.flex_error()
    assert pool.counts == {"replays": 15, "captures": 3, "eager": 0}  # one graph per batch bucket, any context


def test_a_graph_set_captures_again_after_it_was_cleared():
    """A drafter's graphs (GraphSet: the n-gram lookup's, the EAGLE-3 levels') all dropped when their buffers are
    reallocated, then captured again: the new captures take a new memory pool (into the released one's handle the
    allocator refuses them), and replay what they now read."""
    from rlspec.rollout.runtime.graphs import GraphSet

    graphs = GraphSet("cuda")
    for n in (4, 8):  # buffers of a new size: their graphs go, then capture again
        x = torch.arange(n, dtype=torch.float32, device="cuda")
        out = torch.empty_like(x)
        graphs.clear()
        assert graphs.replay("double", lambda: out.copy_(x * 2))
        x += 1
        graphs.replay("double", lambda: None)  # the graph replays; this closure is not called
        assert torch.equal(out, (torch.arange(n, device="cuda") + 1.0) * 2)
    assert graphs.counts == {"captures": 2, "replays": 4}


def test_lazy_capture_neither_synchronises_nor_empties_the_cache(monkeypatch):
    model, cache = _model_and_cache()
    pool = GraphPool(model, cache, "cuda", max_t=1)
    EagerRunner(model, cache, "cuda").run(_tokens(3, 1), torch.full((3,), 40))  # compile first (it may sync)

    def forbidden(*args, **kwargs):
        raise AssertionError("a lazy capture synchronised the device or emptied the allocator's cache")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    pool.run(_tokens(5, 1), torch.full((5,), 40))  # bucket 8, captured mid-"rollout"
    pool.run(_tokens(2, 1), torch.full((2,), 41))  # bucket 2
    assert pool.counts["captures"] == 2 and pool.memory_bytes() >= pool.static.nbytes()


def _hf_greedy(hf, prompt, max_new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=2, pad_token_id=0)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(2) + 1] if 2 in ids else ids


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("graph_mode", ["off", "eager_start"])
def test_greedy_matches_transformers_generate(kind, graph_mode):
    hf = make_tiny_hf(kind).cuda()
    prompts = random_prompts(6, 2, 25, seed=3)
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], graph_mode=graph_mode,
                        free_kv_between_rollouts=False)  # the graphs are inspected below
    got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24))
    assert [r.completion_ids for r in got] == [_hf_greedy(hf, p, 24) for p in prompts]
    assert attention.flex_error() is None, attention.flex_error()
    if graph_mode == "eager_start":
        assert eng.runner.steps.counts["replays"] > 0 and eng.stats()["rollout/graph_pool_mb"] > 0


@pytest.mark.parametrize("width", [1, 2])
def test_greedy_exact_with_speculation_and_graphs(width):
    """Chains and trees verified through captured graphs: output equals plain decoding on the GPU,
    which equals the CPU engine's."""
    from tests.rollout.spec_helpers import ScriptedDrafter
    from tests.rollout.test_engine_spec import oracle_from, reference, spec_engine

    prompts = random_prompts(16, 2, 30, seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    ref = reference(make_tiny_hf("llama", seed=5).cuda(), prompts, params)
    assert ref == reference(make_tiny_hf("llama", seed=5), prompts, params)
    drafter = ScriptedDrafter(TINY_VOCAB, oracle_from(ref), corrupt=0.3, seed=5, tree=width > 1)
    eng = spec_engine(make_tiny_hf("llama", seed=5).cuda(), drafter, width=width, free_kv_between_rollouts=False)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    assert eng.stats()["rollout/accept_len"] > 1.0 and eng.runner.steps.counts["replays"] > 0


def test_seeded_sampling_has_the_target_law():
    """Two-token samples at T=1 on the GPU: reproducible under a seed, and chi-square-consistent with the
    target's exact joint law (8-token vocabulary, 4000 samples)."""
    from scipy.stats import chisquare

    hf = make_tiny_hf("llama", vocab=8).cuda()
    prompt = [3, 4, 5]
    params = SamplingParams(temperature=1.0, max_new_tokens=2, n=4000, seed=0, ignore_eos=True)
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[], max_num_seqs=4000)
    samples = [r.completion_ids for r in eng.generate([prompt], params)]
    assert samples == [r.completion_ids for r in eng.generate([prompt], params)]
    counts = torch.zeros(8, 8)
    for a, b in samples:
        counts[a, b] += 1
    with torch.no_grad():
        def next_law(ids):
            return torch.softmax(hf(torch.tensor([ids], device="cuda")).logits[0, -1].float(), -1).cpu()
        p1 = next_law(prompt)
        joint = torch.stack([p1[a] * next_law(prompt + [a]) for a in range(8)])
    exp = joint.flatten() * counts.sum()
    keep = exp > 5
    obs, exp = counts.flatten()[keep], exp[keep]
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def test_eagle3_drafter_trains_on_cuda_and_stays_exact():
    from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer
    from tests.rollout.speculation.test_eagle3 import eagle_engine, plain

    hf = make_tiny_hf("llama", seed=9).cuda()
    prompts = random_prompts(8, 4, 10, seed=9)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    ref = plain(hf, prompts, params)
    eng = eagle_engine(hf, k=4)
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, lr=3e-3, batch=8, window=32,
                                                            min_tokens=64, publish_every=20))
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    first = trainer.train_steps(1)
    last = trainer.train_steps(100)
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert torch.isfinite(torch.tensor(last)) and last < first, (first, last)
    trainer.start()  # now in its thread, beside rollouts that replay (and may capture) graphs
    trainer.set_idle(True)
    deadline = time.time() + 60
    while trainer.stats.steps < 110 and time.time() < deadline:
        time.sleep(0.05)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref  # swapped weights, still exact
    trainer.stop()
    assert trainer.stats.error is None and trainer.stats.steps >= 110
    assert eng.stats()["drafter/version"] >= 5
