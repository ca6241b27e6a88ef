"""The n-gram drafter looked up on the device (drafters/ngram_device.py): its lookup is prompt lookup (against a
brute-force reference written here), its chains are the host drafter's wherever that one drafts, and an engine
drafting with it is exact (greedy parity, the sampled law) with graphs emulated, rows admitted and retired, and
preemption."""
from __future__ import annotations

import random

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.speculation.drafters import ngram_device
from rlspec.rollout.speculation.drafters.ngram import NgramDrafter
from rlspec.rollout.speculation.drafters.ngram_device import DeviceNgramDrafter, lookup
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import random_prompts
from tests.rollout.law_helpers import one_thread  # noqa: F401  (fixture of the law tests)


def brute_force(docs: list[list[int]], own: int, A: int, D: int) -> tuple[list[int], int]:
    """(draft, matched length) by the definition: over every document of the group, the candidate with the longest
    match (at most A) of the own text's last tokens, then the own text, then the later document, then the newest
    position, with a token after it; its continuation periodic in its document. None: the own last token repeated."""
    t = docs[own]
    n, best = len(t), None
    for g, d in enumerate(docs):
        for p in range(1, len(d)):
            run = 0
            while run < A and run < p and run < n and d[p - 1 - run] == t[n - 1 - run]:
                run += 1
            key = (run, g == own, g, p)
            best = key if best is None or key > best else best
    if best is None:
        return [t[-1]] * D, 0
    run, _, g, p = best
    d = docs[g]
    return [d[p + j % (len(d) - p)] for j in range(D)], run


def random_groups(rng, B: int, G: int, L: int, vocab: int = 3):
    """B rows of G documents (lengths 0..L; the own one at least 1) over a small vocabulary, stale tokens past each
    document's end, as a lookup's inputs and as lists."""
    docs, owns = [], []
    for _ in range(B):
        own = rng.randrange(G)
        lens = [rng.randint(1 if g == own else 0, L) for g in range(G)]
        docs.append([[rng.randrange(vocab) for _ in range(n)] for n in lens])
        owns.append(own)
    padded = torch.tensor([[d + [rng.randrange(vocab) for _ in range(L - len(d))] for d in row] for row in docs],
                          dtype=torch.int32)
    return padded, torch.tensor([[len(d) for d in row] for row in docs]), torch.tensor(owns), docs


@pytest.mark.parametrize("G", [1, 3])
def test_lookup_is_prompt_lookup(G):
    """Random groups over a small vocabulary (matches of every length, own texts of one token, documents shorter than
    the anchor or empty, stale tokens past each end) against the brute force, drafts and matched lengths."""
    rng = random.Random(G)
    A, D = 4, 6
    tokens, lens, own, docs = random_groups(rng, 400, G, 40)
    drafts, matched = lookup(tokens, lens, own, A, D)
    want = [brute_force(row, o, A, D) for row, o in zip(docs, own.tolist())]
    assert drafts.tolist() == [w[0] for w in want]
    assert matched.tolist() == [w[1] for w in want]
    seen = set(matched.tolist())
    assert seen <= set(range(A + 1)) and set(range(1, A + 1)) <= seen and (0 in seen or G > 1)  # every length


@pytest.mark.parametrize("wrong", ["oldest", "shortest", "siblings_first"])
def test_brute_force_tells_wrong_lookups_apart(wrong):
    """The reference is able to fail: the oldest occurrence, the shortest suffix, or a sibling's match preferred to
    the own text's of the same length, differs from it somewhere."""
    rng = random.Random(1)
    _, _, own, docs = random_groups(rng, 200, 3, 30)

    def variant(row, o, A, D):
        t, best = row[o], None
        for g, d in enumerate(row):
            for p in range(1, len(d)):
                run = 0
                while run < A and run < p and run < len(t) and d[p - 1 - run] == t[len(t) - 1 - run]:
                    run += 1
                key = {"oldest": (run, g == o, g, -p), "shortest": (-run if run else -99, g == o, g, p),
                       "siblings_first": (run, g != o, g, p)}[wrong]
                best = (key, g, p, run) if best is None or key > best[0] else best
        if best is None:
            return [t[-1]] * D, 0
        _, g, p, run = best
        return [row[g][p + j % (len(row[g]) - p)] for j in range(D)], run

    assert any(variant(row, o, 4, 5) != brute_force(row, o, 4, 5) for row, o in zip(docs, own.tolist()))


def target():
    from rlspec.bench.host import tiny_model  # peaked logits: rollouts repeat themselves, so n-grams match

    return tiny_model(3)


def engine(graph_mode: str = "off", siblings: bool = True, **kw) -> RolloutEngine:
    spec = SpecConfig(drafter="ngram_device", selector="always", num_draft_tokens=4, online_training=False)
    eng = RolloutEngine(target(), None, spec=spec, eos_token_ids=[2], **kw)
    drafter = eng.speculation.by_name["ngram_device"]
    drafter.graph_mode, drafter.siblings = graph_mode, siblings
    return eng


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(n, 8, 16, seed=seed, vocab=64)


@pytest.mark.parametrize("graph_mode", ["off", "emulate"])
def test_chains_are_the_host_drafters_where_it_drafts(graph_mode, monkeypatch):
    """Siblings off, in a sampled rollout, every proposal is compared with the host n-gram drafter's for the same
    rows at the same moment: where that one drafts (a match of min_ngram tokens), the chains are equal; elsewhere
    the row still drafts (its best shorter match)."""
    seen = {"host": 0, "fallback": 0}
    host = NgramDrafter()
    propose = DeviceNgramDrafter.propose_tensors

    def compared(self, seqs, caps, width):
        out = propose(self, seqs, caps, width)
        want = host.propose(seqs, caps, 1)
        for i, (got, w) in enumerate(zip(out.to_drafts(), want)):
            if len(w):
                assert got.tokens == w.tokens and int(self.last_matched[i]) >= host.anchors[-1]
                seen["host"] += 1
            elif caps[i]:
                assert len(got) == caps[i] and int(self.last_matched[i]) < host.anchors[-1]
                seen["fallback"] += 1
        return out

    monkeypatch.setattr(DeviceNgramDrafter, "propose_tensors", compared)
    eng = engine(graph_mode, siblings=False, max_num_seqs=6)
    params = SamplingParams(temperature=0.5, max_new_tokens=80, n=2, seed=0, ignore_eos=True)
    eng.generate(repetitive_prompts(5, 0), params)
    assert seen["host"] >= 50 and seen["fallback"] >= 10, seen
    if graph_mode == "emulate":
        graphs = eng.speculation.by_name["ngram_device"].graphs
        assert graphs.counts["replays"] > graphs.counts["captures"] > 0


def compare_proposals(monkeypatch, check, size: int = 3) -> None:
    """After every proposal, check(drafter, row, seq, its draft's tokens, its group's texts by sample index as far as
    the drafter had seen them (a live sample: up to this proposal; one done or waiting: up to its last; one never
    proposed for: empty), its cap, its group's samples) for each row that drafts."""
    synced: dict[int, list[int]] = {}  # id(seq) -> its text as of its last proposal
    groups: dict[int, dict] = {}
    propose = DeviceNgramDrafter.propose_tensors

    def compared(self, seqs, caps, width):
        out = propose(self, seqs, caps, width)
        if not max(caps):  # nothing to draft: nothing looked up or sent
            return out
        for s in seqs:
            synced[id(s)] = s.all_ids()
            groups.setdefault(s.prompt_index, {})[id(s)] = s
        for i, (s, got) in enumerate(zip(seqs, out.to_drafts())):
            if caps[i]:  # the group's texts in its samples' order (its table's)
                group = groups[s.prompt_index].values()
                by_sample = {x.sample_index: synced[id(x)] for x in group}
                check(self, i, s, got.tokens, [by_sample.get(j, []) for j in range(size)], caps[i], group)
        return out

    monkeypatch.setattr(DeviceNgramDrafter, "propose_tensors", compared)


@pytest.mark.parametrize("graph_mode", ["off", "emulate"])
def test_drafts_look_up_the_siblings_texts(graph_mode, monkeypatch):
    """Groups of three samples, more samples than rows (siblings finish while others of their group run, slots are
    freed and taken again): every proposal of every row is the brute force over its own text and its siblings' as
    far as the drafter had seen them (a live sibling: up to this proposal; one done or waiting: up to its last), and
    drafts came from siblings' texts."""
    seen = {"rows": 0, "sibling": 0, "sibling_done": 0}

    def check(drafter, i, s, got, docs, cap, group):
        own = s.sample_index
        want, run = brute_force(docs, own, drafter.max_ngram, cap)
        assert got == want and int(drafter.last_matched[i]) == run
        seen["rows"] += 1
        alone, _ = brute_force([docs[own]], 0, drafter.max_ngram, cap)
        seen["sibling"] += want != alone
        seen["sibling_done"] += any(x.finished for x in group)

    compare_proposals(monkeypatch, check)
    eng = engine(graph_mode, max_num_seqs=5)
    params = SamplingParams(temperature=0.5, max_new_tokens=60, n=3, seed=0)
    eng.generate(repetitive_prompts(4, 2), params)
    assert seen["rows"] >= 300 and seen["sibling"] >= 20 and seen["sibling_done"] >= 20, seen


@pytest.mark.parametrize("graph_mode", ["off", "emulate"])
def test_drafts_look_up_the_prompts_earlier_rollouts(graph_mode, monkeypatch):
    """Two calls on the same prompts, two texts of history a prompt: every proposal of the second call is the brute
    force over the prompt's last two finished samples of the first call (oldest first, in the order they finished)
    and the group's texts; drafts came from the history."""
    finished: dict[tuple, list[list[int]]] = {}
    finish = DeviceNgramDrafter.finish

    def logged(self, seq):
        if seq.finished:
            finished.setdefault(tuple(seq.prompt_ids), []).append(list(seq.completion_ids))
        finish(self, seq)

    monkeypatch.setattr(DeviceNgramDrafter, "finish", logged)
    eng = engine(graph_mode, max_num_seqs=5)
    eng.speculation.by_name["ngram_device"].history.per_prompt = 2
    prompts = repetitive_prompts(4, 3)
    eng.generate(prompts, SamplingParams(temperature=0.5, max_new_tokens=40, n=3, seed=0))
    earlier = {p: [list(p) + c for c in comps[-2:]] for p, comps in finished.items()}
    assert all(len(comps) == 3 for comps in finished.values()) and len(earlier) == 4

    seen = {"rows": 0, "history": 0}

    def check(drafter, i, s, got, docs, cap, group):
        assert drafter.members.shape[1] == 5  # a group of three and two texts of history
        past = earlier[tuple(s.prompt_ids)]
        want, run = brute_force(past + docs, len(past) + s.sample_index, drafter.max_ngram, cap)
        assert got == want and int(drafter.last_matched[i]) == run
        seen["rows"] += 1
        seen["history"] += want != brute_force(docs, s.sample_index, drafter.max_ngram, cap)[0]

    compare_proposals(monkeypatch, check)
    eng.generate(prompts, SamplingParams(temperature=0.5, max_new_tokens=40, n=3, seed=1))
    assert seen["rows"] >= 200 and seen["history"] >= 20, seen


def test_greedy_exact_with_history():
    """A second greedy call, the first call's samples looked up as history, is the plain rollout token for token,
    and accepts more than the first (its drafts are the earlier rollouts' continuations)."""
    prompts = repetitive_prompts(5, 4)
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2, ignore_eos=True)
    ref = [r.completion_ids for r in RolloutEngine(target(), None, eos_token_ids=[2]).generate(prompts, params)]
    eng = engine("emulate", max_num_seqs=4)
    accepted = []
    for _ in range(2):
        assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
        accepted.append(eng.stats()["rollout/accept_len"])
    assert eng.speculation.by_name["ngram_device"].history.count(prompts[0]) == 4  # two samples a call
    assert accepted[1] > accepted[0], accepted


def test_unfinished_samples_are_no_history():
    """A partial round's unfinished sample (abandon) leaves no history; a finished one does, once."""
    eng = engine(max_num_seqs=2)
    drafter = eng.speculation.by_name["ngram_device"]
    eng.generate([[3, 4, 5, 3, 4]], SamplingParams(temperature=0, max_new_tokens=4))
    assert drafter.history.count([3, 4, 5, 3, 4]) == 1
    from rlspec.rollout.runtime.sequence import Sequence

    seq = Sequence(0, 0, [7, 8, 9], 10, completion_ids=[1, 2])
    drafter.begin([[seq]])
    drafter.abandon(seq)
    assert drafter.history.count([7, 8, 9]) == 0
    seq.finish_reason = "stop"
    drafter.finish(seq)
    assert drafter.history.count([7, 8, 9]) == 1


@pytest.mark.parametrize("graph_mode", ["off", "emulate"])
@pytest.mark.parametrize("rows,kv_gb", [(3, None), (16, 2e-5)], ids=["admit_retire", "preempted"])
def test_greedy_exact(graph_mode, rows, kv_gb):
    """Greedy float32 rollouts drafting on the device are the plain ones, token for token: more samples than rows
    (slots freed and taken again), and a pool so small that rows are preempted and resumed."""
    prompts = repetitive_prompts(7, 1)
    params = SamplingParams(temperature=0, max_new_tokens=48, n=2, ignore_eos=True)
    plain = RolloutEngine(target(), None, eos_token_ids=[2])
    ref = [r.completion_ids for r in plain.generate(prompts, params)]
    eng = engine(graph_mode, max_num_seqs=rows, max_model_len=128,
                 **({"kv_memory_gb": kv_gb} if kv_gb else {}))
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    stats = eng.stats()
    assert stats["rollout/accept_len"] > 1.1 and stats["rollout/accept_hist/2"] > 0, stats  # several at a time
    if kv_gb:
        assert stats["rollout/preemptions"] > 0


def test_sampled_law_unchanged(one_thread):
    """The joint law of five sampled tokens (the law tests' model, prompt and exact law) with every step drafting
    on the device, multi-token drafts accepted."""
    from tests.rollout.test_engine_spec import law_of_drafter, multi_accepted

    stats = law_of_drafter("ngram_device")
    # the steps with a token to spare drafted (a wave's last step has none), several drafts accepted at once
    assert stats["rollout/spec_step_share"] >= 0.75 and multi_accepted(stats) >= 0.005, stats


def test_trees_are_refused_before_any_step():
    with pytest.raises(ValueError, match="tree_width=1"):
        RolloutEngine(target(), None, eos_token_ids=[2],
                      spec=SpecConfig(drafter="ngram_device", num_draft_tokens=4, tree_width=2))


def test_slots_grow_past_the_rows_and_are_reused():
    """Samples under way beyond the cache's rows (preempted ones keep their text) get slots of a grown buffer, which
    keeps what it held and its trash slot last; a group's slots are handed out again once all its samples are done."""
    eng = engine(max_num_seqs=2)
    drafter = eng.speculation.by_name["ngram_device"]
    eng.generate([[3, 4, 5, 3, 4]], SamplingParams(temperature=0, max_new_tokens=4))  # start(): the cache
    drafter.start([], drafter.cache)  # a call begins: every slot free
    rows = drafter.buf.shape[0] - 1
    drafter.buf[rows - 1, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    slots = [drafter._take_slot() for _ in range(rows + 1)]
    assert slots == list(range(rows + 1)) and drafter.buf.shape[0] == 2 * rows + 1
    assert drafter.buf[rows - 1, :3].tolist() == [7, 8, 9] and drafter.members[-1, 0] == 2 * rows
    record = [[slots[0], slots[1]], 2]  # a group of two
    drafter._state[1], drafter._state[2] = [None, slots[0], 0, record], [None, slots[1], 0, record]
    drafter._release(1)
    assert drafter._take_slot() == rows + 1  # the group's other sample still reads slot 0's text
    drafter._release(2)
    assert sorted(drafter._take_slot() for _ in range(2)) == slots[:2]


def test_graph_modes_checked():
    with pytest.raises(ValueError, match="graph_mode"):
        ngram_device.DeviceNgramDrafter(graph_mode="cuda")
