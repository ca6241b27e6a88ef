"""The paged KV cache inside the engine: exactness and law under forced preemption (a tiny pool),
prompt blocks shared among a prompt's samples, blocks held only for accepted tokens, the budget's
errors, and releasing the pool between rollouts. Every test asserts that the path it names ran."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.law_helpers import (ALPHA, engine_samples, hf_exact_law, make_law_model, one_thread,  # noqa: F401
                                       sequence_pvalue)
from tests.rollout.spec_helpers import OracleDrafter
from tests.rollout.test_engine_ar import hf_greedy

BS = 4


def gib(blocks: int, block_bytes: int) -> float:
    return blocks * block_bytes / 2**30


def engine(hf, blocks=None, spec=None, **kw):
    eagle3 = spec is not None and spec.drafter == "eagle3"
    layers = 2 + eagle3  # tiny Llama (+ the drafter's KV layer)
    block = 2 * layers * BS * 2 * 16 * 4  # K and V, 2 KV heads x 16, float32
    block += eagle3 * BS * 3 * 64 * 4  # the drafter's staged target features: 3 x hidden 64, float32
    budget = {} if blocks is None else {"kv_memory_gb": gib(blocks, block)}
    return RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], kv_block_size=BS,
                         **budget, **kw)


def eagle(width):
    return SpecConfig(drafter="eagle3", num_draft_tokens=3, tree_width=width, selector="always", online_training=False)


@pytest.mark.parametrize("spec,graphs", [(None, None), (eagle(1), "off"), (eagle(2), "off"), (eagle(1), "emulate"),
                                         (eagle(2), "emulate")],
                         ids=["plain", "eagle3-chain", "eagle3-tree", "eagle3-chain-graphs", "eagle3-tree-graphs"])
def test_greedy_equals_transformers_under_forced_preemption(spec, graphs):
    """Greedy rollouts equal transformers' under forced preemption: plainly, with EAGLE-3 chains and trees eager,
    and through the drafter's (emulated) graphs, whose catch-ups and levels read a preempted row's blocks through
    the table wherever they are after it comes back."""
    hf = make_tiny_hf("llama", seed=2)
    prompts = random_prompts(6, 2, 25, seed=3)
    eng = engine(hf, blocks=40, spec=spec)  # the longest sequence needs 13 blocks; 12 sequences want ~130
    if graphs is not None:
        eng.speculation.learned.graph_mode = graphs
    got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, n=2))
    stats = eng.stats()
    assert eng.runner.cache.alloc.capacity == 40
    assert stats["rollout/preemptions"] > 0 and stats["rollout/kv_blocks_used"] <= 40
    for i, r in enumerate(got):
        ref = hf_greedy(hf, prompts[i // 2], 24, eos=2)
        assert r.completion_ids == (ref[: ref.index(2) + 1] if 2 in ref else ref)
    if spec is not None:
        assert stats["rollout/spec_step_share"] > 0.5
    if graphs == "emulate":
        keys = eng.speculation.learned.level_graphs().graphs.graphs
        assert any(k[0] == "catch_up" for k in keys) and any(k[0] != "catch_up" for k in keys)
    assert eng.runner.cache.alloc.used == 0, "every block came back"


def test_prompt_blocks_are_shared_among_samples_and_results_unchanged():
    hf = make_tiny_hf("llama", seed=1)
    prompts = random_prompts(3, 9, 18, seed=6)
    params = SamplingParams(temperature=0, max_new_tokens=12, n=4)
    eng = engine(hf)
    got = [r.completion_ids for r in eng.generate(prompts, params)]
    stats = eng.stats()
    full = sum((len(p) - 1) // BS for p in prompts)
    assert stats["rollout/kv_shared_blocks"] == 3 * full > 0, "each prompt's 3 other samples share its full blocks"
    single = engine(hf)
    ref = [r.completion_ids for p in prompts for r in single.generate([p], SamplingParams(temperature=0, max_new_tokens=12))]
    assert got == [c for c in ref for _ in range(4)]


class _Recorder:
    """Stands in for the drafter's trainer: keeps what finished samples hand over (features, tokens)."""
    topk = 0

    def __init__(self):
        self.samples = []

    def add(self, feats, ids, version, dist, temperature):
        self.samples.append((feats.clone(), list(ids)))

    def latest(self):
        return None


def test_eagle3_features_live_in_the_blocks_shared_and_restaged_after_preemption():
    """The drafter's staged target features are side buffers of the KV blocks: the pool's bytes per block
    count them, a prompt's samples read the prompt's features from the same (shared) slots, and a
    preempted sample's features, freed with its blocks, are staged again by its re-prefill: what every
    sample banks at the end equals the features of one fresh forward over its tokens."""
    hf = make_tiny_hf("llama", seed=2)
    prompts = random_prompts(6, 2, 25, seed=3)
    eng = engine(hf, blocks=40, spec=eagle(1))
    drafter = eng.speculation.learned
    rec = _Recorder()
    drafter.attach(rec)
    seen = []
    orig_finish = drafter.finish

    def finish(seq):  # the slots a sample's prompt positions map to, while it still holds its blocks
        seen.append((seq.prompt_index, eng.runner.cache.owner_slots(id(seq), len(seq.prompt_ids) - 1).tolist()))
        orig_finish(seq)

    drafter.finish = finish
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, n=2))
    stats = eng.stats()
    assert stats["rollout/preemptions"] > 0 and eng.runner.cache.alloc.capacity == 40
    assert set(eng.runner.cache.side) == {"eagle3/features"}
    assert len(rec.samples) == 12
    for feats, ids in rec.samples:
        with torch.no_grad():
            hs = hf(torch.tensor([ids[:len(feats)]]), output_hidden_states=True).hidden_states
        ref = torch.cat([hs[i][0] for i in drafter.aux_layers], -1)
        torch.testing.assert_close(feats, ref, atol=1e-4, rtol=1e-4)
    # samples of one prompt that ran side by side read its full blocks from the very same slots
    by_prompt = {}
    for prompt, slots in seen:
        by_prompt.setdefault(prompt, []).append(slots)
    shared = [p for p, (a, b) in by_prompt.items() if len(prompts[p]) - 1 >= BS and a[:BS] == b[:BS]]
    assert shared, "no prompt's samples shared their staged features"


def test_rejected_drafts_hold_at_most_a_spare_block_past_their_step(monkeypatch):
    """After a step, a row holds the blocks of its positions and at most one more: the block a draft crossing a
    block boundary took stays as a spare (it is the row's next one) instead of going back and being taken again
    at the next step."""
    hf = make_tiny_hf("llama", seed=3)
    eng = engine(hf, spec=eagle(2))
    extra = []
    real = eng._retire

    def check(ctx):
        a = eng.runner.cache.alloc
        for s in ctx.kv.sched.live:
            if not s.finished:
                extra.append(len(a.held(id(s))) - a.blocks_for(s.cache_len + 1))
        real(ctx)

    monkeypatch.setattr(eng, "_retire", check)
    eng.generate(random_prompts(4, 3, 9, seed=2), SamplingParams(temperature=1.0, max_new_tokens=30, n=2, seed=0,
                                                                  ignore_eos=True))
    stats = eng.stats()
    assert stats["rollout/accept_rate"] < 1 and stats["rollout/spec_step_share"] > 0.5  # some drafts were rejected
    assert set(extra) == {0, 1}  # spares were kept, never two


def test_spare_blocks_go_back_before_anyone_is_preempted(monkeypatch):
    """Under memory pressure the spares are handed back first: no sequence is preempted while a live row holds a
    block past its positions' (the scheduler would otherwise evict work to keep blocks nobody has written)."""
    from rlspec.rollout.runtime.scheduler import Scheduler

    hf = make_tiny_hf("llama", seed=2)
    eng = engine(hf, blocks=40, spec=eagle(1))  # the longest sequence needs 13 blocks; 12 sequences want ~130
    calls = []
    real = Scheduler.make_room

    def make_room(self):
        a = self.alloc
        spares = sum(len(a.held(id(s))) > a.blocks_for(s.cache_len + 1) for s in self.live)
        victims = real(self)
        calls.append((spares, len(victims)))
        return victims

    monkeypatch.setattr(Scheduler, "make_room", make_room)
    eng.generate(random_prompts(6, 2, 25, seed=3), SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=0,
                                                                   ignore_eos=True))
    assert eng.stats()["rollout/preemptions"] > 0
    assert any(v for _, v in calls) and all(spares == 0 for spares, v in calls if v)


def test_same_seed_same_rollouts_under_preemption():
    hf = make_tiny_hf("llama", seed=4)
    prompts = random_prompts(4, 4, 12, seed=4)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=12, n=3, seed=7, ignore_eos=True)
    eng = engine(hf, blocks=12)  # the longest sequence needs 6
    first = [(r.completion_ids, r.logprobs) for r in eng.generate(prompts, params)]
    assert eng.stats()["rollout/preemptions"] > 0
    assert [(r.completion_ids, r.logprobs) for r in engine(hf, blocks=12).generate(prompts, params)] == first
    assert [(r.completion_ids, r.logprobs) for r in eng.generate(prompts, params)] == first


VOCAB, PROMPT, LENGTH, N = 8, [3, 4, 5, 1], 5, 10_000  # as test_law.py: no truncation near a tie
LAW = SamplingParams(temperature=0.9, top_p=0.9)


@pytest.fixture(scope="module")
def law():
    hf = make_law_model(VOCAB, seed=0, std=0.3)
    return hf, hf_exact_law(hf, PROMPT, LENGTH, LAW)


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "oracle-chains"])
def test_law_unchanged_under_forced_preemption(law, one_thread, drafted):
    """10k samples of one prompt through a pool of 200 two-position blocks (a sequence needs up to 5):
    admission splits the group, sequences are preempted and re-prefilled, and the joint law of all 5
    tokens is still the target's."""
    hf, (seqs, probs, ranked) = law
    drafter = OracleDrafter(ranked, VOCAB, corrupt=0.2, seed=1) if drafted else None
    block = 2 * 2 * 2 * 1 * 16 * 4  # law model: 2 layers, K and V, block of 2, 1 KV head x 16, float32
    samples, stats = engine_samples(hf, PROMPT, LAW, N, LENGTH, None if drafter is None else (lambda rt: drafter),
                                    width=1, k=3, kv_block_size=2, kv_memory_gb=gib(200, block))
    assert stats["rollout/preemptions"] > 100 and stats["rollout/kv_shared_blocks"] > 0
    assert stats["rollout/kv_blocks_used"] <= 200
    if drafted:
        assert stats["rollout/spec_step_share"] > 0.5
    p = sequence_pvalue(samples, seqs, probs)
    assert p > ALPHA, p


def test_budget_too_small_for_one_sequence_says_how_big_it_must_be():
    eng = engine(make_tiny_hf("llama"), blocks=3)
    with pytest.raises(ValueError, match=r"one sequence of 40 positions needs 10 blocks = .* GiB"):
        eng.generate([[3] * 10], SamplingParams(max_new_tokens=30))


def test_pool_released_between_rollouts_when_asked():
    hf = make_tiny_hf("llama", seed=5)
    prompts = random_prompts(3, 3, 9, seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=10, n=2)
    eng = engine(hf, free_kv_between_rollouts=True)
    first = [r.completion_ids for r in eng.generate(prompts, params)]
    assert eng.runner.cache is None and eng.runner.steps is None
    assert eng.stats()["rollout/kv_cache_mb"] > 0, "the released pool's size is still reported"
    assert [r.completion_ids for r in eng.generate(prompts, params)] == first
    kept = engine(hf)
    assert not kept.free_kv_between_rollouts, "off on CPU by default"
    kept.generate(prompts, params)
    assert kept.runner.cache is not None
    eng.release_kv()
    assert eng.runner.cache is None


@pytest.mark.parametrize("block_size,prompt,admitted", [(128, 64, 8), (128, 120, 4), (16, 64, 6)])
def test_admission_keeps_headroom_in_positions_not_blocks(block_size, prompt, admitted):
    """The headroom kept per live sequence at admission is what it grows into over its next HEADROOM_TOKENS
    tokens. Rows of 64 prompt tokens in 128-position blocks (FlexAttention's, on CUDA) stay inside their block:
    a pool of one block a row admits every row (a block of headroom per row admitted half: gpu-check's 7B rows
    at batch 128 ran as two waves). Rows that will cross into a second block soon (120 + 16 > 128), and
    16-position blocks (each row's next block), keep one block each."""
    from rlspec.rollout.runtime.blocks import BlockAllocator
    from rlspec.rollout.runtime.scheduler import HEADROOM_TOKENS, Scheduler
    from rlspec.rollout.runtime.sequence import Sequence

    assert HEADROOM_TOKENS == 16
    groups = [[Sequence(i, 0, list(range(prompt)), max_new_tokens=32)] for i in range(8)]
    per_row = -(-(prompt + 1) // block_size)  # the blocks a fresh row takes: its prompt and first position
    sched = Scheduler(groups, rows=8, alloc=BlockAllocator(8 * per_row + 1, block_size))
    assert sum(len(g) for g in sched.admit()) == admitted
