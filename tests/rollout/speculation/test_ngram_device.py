"""The n-gram drafter looked up on the device (drafters/ngram_device.py): its lookup is prompt lookup (against a
brute-force reference written here), its chains are the host drafter's wherever that one drafts, and an engine
drafting with it is exact (greedy parity, the sampled law) with graphs emulated, rows admitted and retired, and
preemption."""
from __future__ import annotations

import random

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.drafters import ngram_device
from rlspec.rollout.speculation.drafters.ngram import NgramDrafter
from rlspec.rollout.speculation.drafters.ngram_device import DeviceNgramDrafter, lookup
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import random_prompts
from tests.rollout.law_helpers import one_thread  # noqa: F401  (fixture of the law tests)


def brute_force(tokens: list[int], A: int, D: int) -> tuple[list[int], int]:
    """(draft, matched length) by the definition: the longest a <= A whose last-a-token suffix occurred earlier with
    a token after it, its newest such occurrence, the continuation periodic; none: the last token repeated."""
    n = len(tokens)
    for a in range(A, 0, -1):
        for p in range(n - 1, a - 1, -1):  # newest first; p = n would be the suffix itself
            if tokens[p - a:p] == tokens[n - a:]:
                return [tokens[p + j % (n - p)] for j in range(D)], a
    return [tokens[-1]] * D, 0


def test_lookup_is_prompt_lookup():
    """Random rows over a small vocabulary (matches of every length, rows of one token, rows shorter than the anchor,
    stale tokens past each row's end) against the brute force, drafts and matched lengths."""
    rng = random.Random(0)
    A, D, L = 4, 6, 48
    rows = [[rng.randrange(3) for _ in range(rng.randint(1, L))] for _ in range(400)]
    tokens = torch.tensor([r + [rng.randrange(3) for _ in range(L - len(r))] for r in rows], dtype=torch.int32)
    drafts, matched = lookup(tokens, torch.tensor([len(r) for r in rows]), A, D)
    want = [brute_force(r, A, D) for r in rows]
    assert drafts.tolist() == [w[0] for w in want]
    assert matched.tolist() == [w[1] for w in want]
    assert set(matched.tolist()) == set(range(A + 1))  # every matched length occurred, none too


@pytest.mark.parametrize("wrong", ["oldest", "shortest"])
def test_brute_force_tells_wrong_lookups_apart(wrong):
    """The reference is able to fail: the oldest occurrence, or the shortest suffix, differs from it somewhere."""
    rng = random.Random(1)
    rows = [[rng.randrange(3) for _ in range(rng.randint(6, 30))] for _ in range(200)]

    def variant(t, A, D):
        n = len(t)
        order = range(1, A + 1) if wrong == "shortest" else range(A, 0, -1)
        for a in order:
            ps = range(a, n) if wrong == "oldest" else range(n - 1, a - 1, -1)
            for p in ps:
                if t[p - a:p] == t[n - a:]:
                    return [t[p + j % (n - p)] for j in range(D)], a
        return [t[-1]] * D, 0

    assert any(variant(r, 4, 5) != brute_force(r, 4, 5) for r in rows)


def target():
    from rlspec.bench.host import tiny_model  # peaked logits: rollouts repeat themselves, so n-grams match

    return tiny_model(3)


def engine(drafter: str, graph_mode: str = "off", **kw) -> RolloutEngine:
    spec = SpecConfig(drafter=drafter, selector="always", num_draft_tokens=4, online_training=False)
    eng = RolloutEngine(target(), None, spec=spec, eos_token_ids=[2], **kw)
    for d in eng.speculation.by_name.values():
        if hasattr(d, "graph_mode"):
            d.graph_mode = graph_mode
    return eng


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(n, 8, 16, seed=seed, vocab=64)


@pytest.mark.parametrize("graph_mode", ["off", "emulate"])
def test_chains_are_the_host_drafters_where_it_drafts(graph_mode, monkeypatch):
    """In a sampled rollout, every proposal is compared with the host n-gram drafter's for the same rows at the same
    moment: where that one drafts (a match of min_ngram tokens), the chains are equal; elsewhere the row still
    drafts (its best shorter match)."""
    seen = {"host": 0, "fallback": 0}
    host = NgramDrafter()
    propose = DeviceNgramDrafter.propose_tensors

    def compared(self, seqs, caps, width):
        out = propose(self, seqs, caps, width)
        want = host.propose(seqs, caps, 1)
        for i, (got, w) in enumerate(zip(out.to_drafts(), want)):
            if len(w):
                assert got.tokens == w.tokens and int(self.last_matched[i]) >= self.min_ngram
                seen["host"] += 1
            elif caps[i]:
                assert len(got) == caps[i] and int(self.last_matched[i]) < self.min_ngram
                seen["fallback"] += 1
        return out

    monkeypatch.setattr(DeviceNgramDrafter, "propose_tensors", compared)
    eng = engine("ngram_device", graph_mode, max_num_seqs=6)
    params = SamplingParams(temperature=0.5, max_new_tokens=80, n=2, seed=0, ignore_eos=True)
    eng.generate(repetitive_prompts(5, 0), params)
    assert seen["host"] >= 50 and seen["fallback"] >= 10, seen
    if graph_mode == "emulate":
        graphs = eng.speculation.by_name["ngram_device"].graphs
        assert graphs.counts["replays"] > graphs.counts["captures"] > 0


@pytest.mark.parametrize("graph_mode", ["off", "emulate"])
@pytest.mark.parametrize("rows,kv_gb", [(3, None), (16, 2e-5)], ids=["admit_retire", "preempted"])
def test_greedy_exact(graph_mode, rows, kv_gb):
    """Greedy float32 rollouts drafting on the device are the plain ones, token for token: more samples than rows
    (slots freed and taken again), and a pool so small that rows are preempted and resumed."""
    prompts = repetitive_prompts(7, 1)
    params = SamplingParams(temperature=0, max_new_tokens=48, n=2, ignore_eos=True)
    plain = RolloutEngine(target(), None, eos_token_ids=[2])
    ref = [r.completion_ids for r in plain.generate(prompts, params)]
    eng = engine("ngram_device", graph_mode, max_num_seqs=rows, max_model_len=128,
                 **({"kv_memory_gb": kv_gb} if kv_gb else {}))
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    stats = eng.stats()
    assert stats["rollout/accept_len"] > 1.1 and stats["rollout/accept_hist/2"] > 0, stats  # several at a time
    if kv_gb:
        assert stats["rollout/preemptions"] > 0


def test_sampled_law_unchanged(monkeypatch, one_thread):
    """The joint law of five sampled tokens (the law tests' model, prompt and exact law) with every step drafting
    on the device, multi-token drafts accepted."""
    from tests.rollout.law_helpers import ALPHA, sequence_pvalue
    from tests.rollout.test_engine_spec import LAW_N, LAW_PROMPT, law_setup, multi_accepted

    hf, params, seqs, probs, _ = law_setup(1.0, 1.0, LAW_N)
    spec = SpecConfig(drafter="ngram_device", selector="always", num_draft_tokens=3, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], max_num_seqs=LAW_N)
    eng.eos_token_ids = set()
    samples = torch.tensor([r.completion_ids for r in eng.generate([LAW_PROMPT], params)])
    assert sequence_pvalue(samples, seqs, probs) > ALPHA
    stats = eng.stats()
    # every step with a token to spare drafted (the last of the four has none), several drafts accepted at once
    assert stats["rollout/spec_step_share"] == 0.75 and multi_accepted(stats) >= 0.005, stats


def test_trees_are_refused_before_any_step():
    with pytest.raises(ValueError, match="tree_width=1"):
        RolloutEngine(target(), None, eos_token_ids=[2],
                      spec=SpecConfig(drafter="ngram_device", num_draft_tokens=4, tree_width=2))


def test_slots_grow_past_the_rows_and_are_reused():
    """Samples under way beyond the cache's rows (preempted ones keep their tokens) get slots of a grown buffer, and
    a finished sample's slot is the next one handed out."""
    eng = engine("ngram_device", max_num_seqs=2)
    drafter = eng.speculation.by_name["ngram_device"]
    eng.generate([[3, 4, 5, 3, 4]], SamplingParams(temperature=0, max_new_tokens=4))  # start(): the cache
    drafter.start([], drafter.cache)  # a call begins: every slot free
    rows = drafter.buf.shape[0]
    slots = [drafter._take_slot() for _ in range(rows + 1)]
    assert slots == list(range(rows + 1)) and drafter.buf.shape[0] == 2 * rows
    drafter._state[1] = [None, slots[1], 0]
    drafter._release(1)
    assert drafter._take_slot() == slots[1]


def test_graph_modes_checked():
    with pytest.raises(ValueError, match="graph_mode"):
        ngram_device.DeviceNgramDrafter(graph_mode="cuda")
