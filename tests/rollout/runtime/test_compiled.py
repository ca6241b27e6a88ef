"""rollout/runtime/compiled.py: the compiled step equals the eager one (float32), greedy decoding through it
equals transformers' generate, and speculation through it keeps the target's law.

Compiling costs seconds per (batch 1 or many, tokens-per-row bucket), so these tests share one tiny model
shape and few buckets; inductor's artefacts are cached on disk, so a second run loads them."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.compiled import CompiledRunner, resolve_compile
from rlspec.rollout.runtime.graphs import EagerRunner
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.runtime.test_graphs import _runner, _tokens, _tree
from tests.rollout.test_engine_ar import hf_greedy


@pytest.fixture(autouse=True)
def _every_shape_compiled(monkeypatch):
    """On a CPU only single-row steps compile by default; here every shape does, as on CUDA."""
    monkeypatch.setattr(CompiledRunner, "CPU_EVERY_SHAPE", True)


@pytest.mark.parametrize("B,T,tree", [(1, 1, False), (5, 1, False), (5, 3, False), (3, 4, True)],
                         ids=["b1-decode", "b5-decode", "b5-chain3-padded", "b3-tree"])
def test_compiled_step_equals_eager_step(B, T, tree):
    """Same logits and hidden states as EagerRunner at one step (T=3 runs padded to 4 nodes); and the keys and
    values it wrote are the ones the eager step writes (the next step, eager, sees the same cache)."""
    runner, lens = _runner(rows=8, length=64, n_prompts=5)
    start = lens[:B].clone()
    tokens = _tokens(B, T, seed=B + T)
    depths, mask = _tree(B) if tree else (None, None)
    eager, comp = EagerRunner(runner.model, runner.cache, "cpu"), CompiledRunner(runner.model, runner.cache, "cpu")
    ref, ref_h = eager.run(tokens, start, depths, mask, hidden_layers=(1,))
    nxt = _tokens(B, 1, seed=9)
    ref_next = eager.run(nxt, start + T)[0]
    got, got_h = comp.run(tokens, start, depths, mask, hidden_layers=(1,))  # rewrites the same slots
    got_next = eager.run(nxt, start + T)[0]
    assert comp.counts == {"fused": 0, "compiled": 1, "eager": 0}
    assert got.shape == ref.shape and got_h[1].shape == ref_h[1].shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_h[1], ref_h[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_next, ref_next, atol=1e-4, rtol=1e-4)


def test_compiled_engine_greedy_matches_transformers():
    """Plain decoding, chains and trees through compiled steps: token for token transformers' greedy output.
    Four short prompts (contexts within two 16-position blocks), one row at a time: each new batch size, token
    count or context span is a graph to compile, seconds of C++ each on a fresh machine. Batched compiled steps
    are held against eager ones above (b5, b3) and keep the law in tests/rollout/speculation/test_law.py."""
    hf = make_tiny_hf("llama")
    prompts = random_prompts(4, 2, 12, seed=3)
    specs = [None, SpecConfig(drafter="suffix", num_draft_tokens=3, selector="always"),
             SpecConfig(drafter="suffix", num_draft_tokens=3, tree_width=2, selector="always")]
    refs = []
    for p in prompts:
        ref = hf_greedy(hf, p, 12, eos=2)
        refs.append(ref[: ref.index(2) + 1] if 2 in ref else ref)
    for spec in specs:
        eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], spec=spec, compile_mode="on",
                            max_num_seqs=1)
        # twice: the second call's suffix index holds the first call's outputs, so its drafts are accepted
        for _ in range(2):
            got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
            assert [r.completion_ids for r in got] == refs
        assert isinstance(eng.runner.steps, CompiledRunner) and eng.runner.steps.counts["eager"] == 0
        widest = 1 if spec is None else 4 if spec.tree_width == 1 else 8  # a tree of 3 drafts, width 2: up to 7 nodes
        assert (False, widest) in eng.runner.steps.seen  # (batched, padded tokens) of the widest step, compiled
        if spec is not None:
            assert eng.stats().get("rollout/accept_len", 1.0) > 1.0  # drafts were verified and accepted


def test_compile_mode_is_checked_at_construction():
    assert resolve_compile("on", "cpu") and not resolve_compile("off", "cpu")
    with pytest.raises(ValueError, match="compile must be one of"):
        resolve_compile("fast", "cpu")


def test_a_step_that_compiles_is_marked_fresh(dynamo_only):
    """A step during which dynamo compiled (its shape's first use in the process) says so: `fresh`."""
    import torch._dynamo

    torch._dynamo.reset()  # other tests compiled these shapes already
    runner, lens = _runner(rows=8, length=64, n_prompts=5)
    runner.steps = comp = CompiledRunner(runner.model, runner.cache, "cpu")
    runner.step(_tokens(1, 1), lens[:1])
    assert runner.fresh
    runner.step(_tokens(1, 1, seed=1), lens[:1] + 1)
    assert not runner.fresh
    runner.step(_tokens(1, 3), lens[:1] + 2)  # a new bucket (t = 4)
    assert runner.fresh
    EagerRunner.run(comp, _tokens(1, 1), lens[:1] + 5)
    runner.step(_tokens(2, 33), lens[:2])  # no bucket: eager, never fresh
    assert not runner.fresh and comp.counts["eager"] == 1


def test_the_selector_never_learns_a_compiling_steps_time(monkeypatch):
    """A step that compiled is no measure of its cost: a 1000x outlier that the cost model's average would
    carry for dozens of steps, keeping a good arm off. The engine feeds such a step to the selector without its
    time, its acceptance alone (steps marked fresh here, and made to take as long as a compile: eager steps, since
    the compiles themselves, seconds of CPU, would prove nothing more)."""
    import time

    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama")), None, eos_token_ids=[2],
                        spec=SpecConfig(drafter="suffix", num_draft_tokens=3))
    prompts = random_prompts(4, 3, 12, seed=1)
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))  # calibration happens here
    eng.stats()
    seen, fresh = [], []
    observe, step = eng.speculation.observe_step, eng.runner.step
    monkeypatch.setattr(eng.speculation, "observe_step", lambda *a, **k: (seen.append(a[2]), observe(*a, **k)))

    def slow_first_steps(*a, **k):
        out = step(*a, **k)
        if len(fresh) % 2 == 0:  # as if this step had compiled its shape
            eng.runner.fresh = True
            time.sleep(0.3)
        fresh.append(eng.runner.fresh)
        return out

    monkeypatch.setattr(eng.runner, "step", slow_first_steps)
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))
    assert eng.stats()["rollout/decode_steps"] == len(fresh) and sum(fresh) >= 2
    timed = [t for t in seen if t is not None]  # a drafted step that compiled: its acceptance alone (None)
    assert len(timed) == len(fresh) - sum(fresh)  # every step that did not compile gave its time, and only those
    assert max(timed) < 0.2  # only real steps' times: milliseconds
