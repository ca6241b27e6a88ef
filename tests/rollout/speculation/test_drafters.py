"""Model-free drafters: n-gram (prompt lookup) and suffix (siblings, history, recent rollouts)."""
import random

import pytest

from rlspec.rollout.speculation.drafters.base import Draft, make_drafter
from rlspec.rollout.speculation.drafters.ngram import NgramDrafter, NgramIndex
from rlspec.rollout.speculation.drafters.suffix import SuffixDrafter, best_first
from rlspec.rollout.runtime.sequence import Sequence


def make_seq(prompt, completion=(), pi=0, si=0, max_new=1000) -> Sequence:
    s = Sequence(pi, si, list(prompt), max_new)
    grow(s, completion)
    return s


def grow(seq: Sequence, tokens) -> None:
    seq.append(list(tokens), [0.0] * len(tokens), set())


def check_tree(d: Draft, max_tokens: int, width: int) -> None:
    """The protocol's shape rules: size, topological parents, children per node."""
    assert len(d.tokens) == len(d.parents) <= max_tokens
    children: dict[int, int] = {}
    for i, p in enumerate(d.parents):
        assert -1 <= p < i
        children[p] = children.get(p, 0) + 1
    assert all(c <= width for c in children.values())
    if width == 1:
        assert d.is_chain


# ---- registry ---------------------------------------------------------------------------------
def test_registry_builds_both_by_name():
    ngram, suffix = make_drafter("ngram", max_ngram=3), make_drafter("suffix", history_per_prompt=2)
    assert isinstance(ngram, NgramDrafter) and ngram.anchors == (3, 2)
    assert isinstance(suffix, SuffixDrafter) and suffix.history_per_prompt == 2
    assert (ngram.name, suffix.name) == ("ngram", "suffix")
    with pytest.raises(ValueError, match="registered"):
        make_drafter("nope")


# ---- the index --------------------------------------------------------------------------------
def test_index_finds_newest_first_and_survives_removal():
    idx = NgramIndex((2,))
    a = idx.add([1, 2, 3])
    b = idx.add([1, 2, 4, 9])
    conts = lambda: [idx.continuation(x, 1)[0] for x in idx.find([7, 1, 2], 0, 10)]  # noqa: E731
    assert conts() == [4, 3]
    idx.remove(b)
    assert conts() == [3]
    idx.remove(a)
    assert conts() == [] and idx.num_tokens == 0 and idx.head == [{}]


def test_index_never_matches_a_document_at_its_own_end():
    idx = NgramIndex((2,))
    doc = idx.add([5, 6])
    assert idx.find([5, 6], 0, 10) == []
    idx.extend(doc, [7, 5, 6])  # now "5 6" occurred before the end: a loop of period 3
    assert [idx.continuation(x, 5, periodic=True) for x in idx.find([5, 6], 0, 10)] == [[7, 5, 6, 7, 5]]


# ---- n-gram -----------------------------------------------------------------------------------
def test_ngram_continues_a_repeated_pattern():
    d = NgramDrafter()
    s = make_seq([10, 11, 12, 13, 14, 15, 16, 30, 31], [10, 11, 12])
    d.begin([[s]])
    assert d.propose([s], [4], 1)[0].tokens == [13, 14, 15, 16]
    grow(s, [13, 99])  # the pattern breaks: nothing ends in "13 99" earlier
    assert d.propose([s], [4], 1)[0].tokens == []


def test_ngram_prefers_the_longest_then_newest_match():
    d = NgramDrafter(max_ngram=3, min_ngram=2)
    prompt = [1, 2, 3, 40, 9, 2, 3, 50, 8, 2, 3, 60]
    assert d.propose([make_seq(prompt, [1, 2, 3])], [1], 1)[0].tokens == [40]  # 3-gram beats newer 2-grams
    assert d.propose([make_seq(prompt, [7, 2, 3])], [1], 1)[0].tokens == [60]  # newest 2-gram


def test_ngram_extends_a_loop_periodically():
    s = make_seq([7, 8, 9], [7, 8])
    assert NgramDrafter().propose([s], [6], 1)[0].tokens == [9, 7, 8, 9, 7, 8]


def test_ngram_tree_branches_on_distinct_next_tokens():
    prompt = [1, 2, 70, 0, 1, 2, 80, 0, 1, 2, 80, 71]
    d = NgramDrafter(max_ngram=2).propose([make_seq(prompt, [1, 2])], [4], 2)[0]
    check_tree(d, 4, 2)
    assert [d.tokens[i] for i, p in enumerate(d.parents) if p == -1] == [80, 70]  # more frequent first
    assert d.tokens == [80, 71, 70, 0]


# ---- suffix -----------------------------------------------------------------------------------
def test_suffix_proposes_a_siblings_continuation():
    d = SuffixDrafter()
    ahead, behind = make_seq([1, 2, 3], [10, 11, 12, 13, 14, 15, 16], si=0), make_seq([1, 2, 3], [10, 11], si=1)
    d.begin([[ahead, behind]])
    drafts = d.propose([ahead, behind], [4, 4], 1)
    assert drafts[1].tokens == [12, 13, 14, 15]
    assert drafts[0].tokens == []  # the leader's own suffix does not match itself


def test_suffix_sees_tokens_appended_since_the_last_step():
    d = SuffixDrafter()
    a, b = make_seq([1, 2, 3], [10], si=0), make_seq([1, 2, 3], [10], si=1)
    d.begin([[a, b]])
    assert d.propose([a, b], [3, 3], 1)[1].tokens == []
    grow(a, [20, 21, 22, 23])
    assert d.propose([a, b], [3, 3], 1)[1].tokens == [20, 21, 22]


def test_suffix_trie_follows_the_majority():
    d = SuffixDrafter(min_prob=0.0)
    sibs = [make_seq([5, 6, 7], c, si=i) for i, c in enumerate([[1, 2, 3, 4, 40], [1, 2, 3, 4, 41],
                                                                  [1, 2, 3, 4, 41], [1, 2]])]
    d.begin([sibs])
    chain = d.propose(sibs, [0, 0, 0, 3], 1)[3]
    assert chain.tokens == [3, 4, 41]
    tree = d.propose(sibs[3:], [4], 2)[0]
    check_tree(tree, 4, 2)
    assert sorted(zip(tree.tokens, tree.parents)) == [(3, -1), (4, 0), (40, 1), (41, 1)]


def test_suffix_remembers_finished_samples_of_the_prompt():
    d = SuffixDrafter()
    old = make_seq([1, 2, 3], [10, 11, 12, 13, 14, 2])
    d.begin([[old]])
    d.propose([old], [4], 1)
    d.finish(old)
    assert d._seqs == {}
    new = make_seq([1, 2, 3], [10])  # a later generate call: the same prompt again
    d.begin([[new]])
    assert d.propose([new], [8], 1)[0].tokens == [11, 12, 13, 14, 2]


def test_suffix_uses_recent_rollouts_of_other_prompts_but_prefers_its_own():
    d = SuffixDrafter()
    for prompt, comp in (([1, 2, 3], [50, 51, 52, 53, 54]), ([4, 5, 6], [50, 51, 60, 61, 62])):
        s = make_seq(prompt, comp)
        d.begin([[s]])
        d.finish(s)
    other = make_seq([7, 8, 9], [50, 51])  # unseen prompt: the global window, newest first
    own = make_seq([1, 2, 3], [9, 50, 51])  # same length matches: its own prompt's history wins
    d.begin([[other], [own]])
    assert [x.tokens for x in d.propose([other, own], [2, 2], 1)] == [[60, 61], [52, 53]]


def test_suffix_global_window_takes_finished_samples_when_settled():
    """finish() queues a sample for the global window (indexing it is the engine's work while a step runs);
    settle() and begin() index what is queued. Its own prompt's index has it at once."""
    d = SuffixDrafter()
    done, other, sibling = make_seq([1, 2, 3], [50, 51, 52, 53]), make_seq([7, 8, 9], [50, 51]), \
        make_seq([1, 2, 3], [50, 51], si=1)
    d.begin([[done, sibling], [other]])
    d.finish(done)
    assert d.propose([other], [2], 1)[0].tokens == []  # not in the window yet
    assert d.propose([sibling], [2], 1)[0].tokens == [52, 53]  # its prompt's index has it
    d.settle()
    assert d.propose([other], [2], 1)[0].tokens == [52, 53]


def test_suffix_memory_stays_bounded():
    d = SuffixDrafter(history_per_prompt=3, max_prompts=5, history_tokens=400, global_docs=10, global_tokens=150)
    rng = random.Random(0)
    for p in range(40):
        prompt = [rng.randrange(50) for _ in range(6)]
        group = [make_seq(prompt, [rng.randrange(50) for _ in range(rng.randrange(1, 30))], pi=p, si=i)
                 for i in range(4)]
        for _ in range(2):  # epochs: the prompt comes back
            group = [make_seq(prompt, s.completion_ids, pi=p, si=s.sample_index) for s in group]
            d.begin([group])
            d.propose(group, [4] * 4, 2)
            for s in group:
                d.finish(s)
        sizes = d.sizes()
        assert sizes["prompts"] <= 5 and sizes["global_docs"] <= 10 and sizes["global_tokens"] <= 150
        assert sizes["prompt_tokens"] <= 400 and sizes["live_samples"] == 0
        assert sizes["hot_prompts"] == 0  # no live sample: only raw tokens are kept per prompt
        assert all(len(st.history) <= 3 for st in d._prompts.values())
        assert all(len(h) <= d._global.num_tokens for h in d._global.head)  # evicted n-grams left the heads


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_works_without_begin_and_forgets_finished_samples(name):
    d = make_drafter(name)
    s = make_seq([3, 4, 5, 6, 3, 4], [5])
    assert d.propose([s], [2], 1)[0].tokens == [6, 3]
    d.finish(s)
    assert d._seqs == {}


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_samples_finished_without_finish_call_are_released(name):
    d = make_drafter(name)
    done_at_admission, running = make_seq([1, 2], [9], si=0), make_seq([1, 2], [3], si=1)
    done_at_admission.finish_reason = "stop"
    d.begin([[done_at_admission, running]])
    assert list(d._seqs) == [id(running)]
    running.finish_reason = "length"  # the engine forgot to call finish()
    d.begin([[make_seq([5, 6], [7])]])
    assert len(d._seqs) == 1


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_empty_drafts_when_nothing_matches_or_no_budget(name):
    d = make_drafter(name)
    a, b = make_seq([1, 2, 3], [4], si=0), make_seq([1, 2, 3], [5], si=1)
    d.begin([[a, b]])
    assert [len(x) for x in d.propose([a, b], [4, 4], 2)] == [0, 0]
    loop = make_seq([7, 8, 7, 8], [7, 8])
    assert [len(x) for x in d.propose([loop], [0], 1)] == [0]
    d.finish(a)
    d.finish(b)


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_drafts_respect_width_budget_and_order(name):
    """Property test: random groups over a tiny vocabulary (many matches), grown step by step."""
    rng = random.Random(1)
    d = make_drafter(name)
    for trial in range(30):
        vocab, n = rng.randint(2, 6), rng.randint(1, 4)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        group = [make_seq(prompt, [rng.randrange(vocab)], pi=trial, si=i) for i in range(n)]
        d.begin([group])
        for _ in range(12):
            caps, width = [rng.randint(0, 9) for _ in group], rng.randint(1, 4)
            for s, cap, draft in zip(group, caps, d.propose(group, caps, width)):
                check_tree(draft, cap, width)
                grow(s, [rng.randrange(vocab) for _ in range(rng.randint(1, 3))])
        for s in group:
            d.finish(s)
    assert d._seqs == {}


def test_best_first_shape_on_random_continuations():
    rng = random.Random(2)
    for _ in range(300):
        conts = [[rng.randrange(3) for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(0, 10))]
        m, width = rng.randint(0, 12), rng.randint(1, 3)
        d = best_first(conts, m, width, min_prob=rng.choice([0.0, 0.1, 0.5]))
        check_tree(d, m, width)
        paths = {tuple(c[:k]) for c in conts for k in range(1, len(c) + 1)}
        for i in range(len(d)):  # every node is a prefix some continuation had
            path, j = [], i
            while j >= 0:
                path.append(d.tokens[j])
                j = d.parents[j]
            assert tuple(reversed(path)) in paths
