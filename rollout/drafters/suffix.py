"""Suffix drafting: propose what followed the context's suffix in this prompt's other rollouts.

A GRPO group samples one prompt n times, and a prompt returns every epoch, so the best evidence
for how a sample continues is how its siblings (live right now) and its earlier rollouts went on
from the same words (the idea of SuffixDecoding, Seer and RhymeRL). Sources, per query:

- local (one `NgramIndex` per prompt): the prompt itself, every live sample of the prompt (each
  indexed as it grows, so a sibling ahead of this one is found; a sample's own earlier text counts,
  its own end cannot match itself), and up to `history_per_prompt` finished samples of it;
- global: the last `global_docs` finished samples of any prompt (shared boilerplate, formats).

Query: the longest suffix of the context found (anchor lengths from longest to shortest; at equal
length the local index wins), up to `max_matches` newest occurrences. Their continuations make a
count-weighted trie; the draft grows best-first by path count (the empirical probability of the
path) taking at most `width` children per node, until `max_tokens` nodes or until the best
remaining path falls under `min_prob` of the matches. Width 1 gives the most frequent path.

Memory is bounded: finished samples per prompt (FIFO), prompts remembered (LRU, by count and by
tokens held; prompts with live samples are kept), and the global window (by samples and tokens).
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from rollout.drafters.base import Draft, register
from rollout.drafters.ngram import _SHIFT, NgramIndex, context_tail
from rollout.sequence import Sequence


@dataclass
class _PromptStore:
    index: NgramIndex
    prompt_doc: int
    live: set[int] = field(default_factory=set)  # doc ids of samples still generating
    history: deque[int] = field(default_factory=deque)  # finished samples, oldest first
    evicted: bool = False  # a history doc left since the prompt doc was indexed (chains cut)


@dataclass
class _SeqState:
    seq: Sequence
    store: _PromptStore
    doc: int
    tail: int  # prompt tokens copied in front of the completion in the doc
    seen: int  # completion tokens indexed so far
    last_used: int  # propose call counter, to drop states a failed generate left behind


@register("suffix")
class SuffixDrafter:
    """Suffix lookup over siblings, earlier rollouts of the prompt, recent rollouts and the prompt."""

    name = "suffix"
    deterministic = True

    def __init__(self, anchors: tuple[int, ...] = (8, 5, 3, 2), max_matches: int = 16, min_prob: float = 0.1,
                 history_per_prompt: int = 16, max_prompts: int = 1024, history_tokens: int = 262_144,
                 global_docs: int = 256, global_tokens: int = 131_072, max_live: int = 4096):
        self.anchors = tuple(sorted(set(anchors), reverse=True))
        self.max_matches, self.min_prob = max_matches, min_prob
        self.history_per_prompt, self.max_prompts, self.history_tokens = history_per_prompt, max_prompts, history_tokens
        self.global_docs, self.global_tokens, self.max_live = global_docs, global_tokens, max_live
        self._prompts: OrderedDict[tuple[int, ...], _PromptStore] = OrderedDict()  # LRU, oldest first
        self._global = NgramIndex(self.anchors)
        self._global_fifo: deque[int] = deque()
        self._seqs: dict[int, _SeqState] = {}  # id(seq) -> state; dropped at finish
        self._calls = 0

    # ---- the protocol -------------------------------------------------------------------------
    def begin(self, groups: list[list[Sequence]]) -> None:
        for group in groups:
            for seq in group:
                self._new_state(seq)
        self._drop_stale()
        self._trim_prompts()

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        self._calls += 1
        states = [self._state(s) for s in seqs]
        for st in states:  # index every live sample's new tokens before any query sees its siblings
            self._sync(st)
        return [self._draft(st, m, width) if m > 0 else Draft() for st, m in zip(states, max_tokens)]

    def finish(self, seq: Sequence) -> None:
        st = self._state(seq)
        self._sync(st)
        del self._seqs[id(seq)]
        store = st.store
        store.live.discard(st.doc)
        store.history.append(st.doc)
        while len(store.history) > self.history_per_prompt:
            store.index.remove(store.history.popleft())
            store.evicted = True
        tail = seq.prompt_ids[-st.tail:] if st.tail else []
        self._global_fifo.append(self._global.add(tail + seq.completion_ids, start=st.tail))
        while self._global_fifo and (len(self._global_fifo) > self.global_docs
                                     or self._global.num_tokens > self.global_tokens):
            self._global.remove(self._global_fifo.popleft())
        self._trim_prompts()

    # ---- bookkeeping --------------------------------------------------------------------------
    def _store(self, prompt: list[int]) -> _PromptStore:
        key = tuple(prompt)
        store = self._prompts.get(key)
        if store is None:
            index = NgramIndex(self.anchors)
            store = self._prompts[key] = _PromptStore(index, index.add(prompt))
        else:
            self._prompts.move_to_end(key)
            if store.evicted and not store.live:  # re-index the prompt so chains reach it again
                store.index.remove(store.prompt_doc)
                store.prompt_doc, store.evicted = store.index.add(prompt), False
        return store

    def _new_state(self, seq: Sequence) -> _SeqState:
        store = self._store(seq.prompt_ids)
        tail = min(len(seq.prompt_ids), self.anchors[0] - 1)  # enough left context for the first n-grams
        doc = store.index.add(seq.prompt_ids[len(seq.prompt_ids) - tail:] + seq.completion_ids, start=tail)
        store.live.add(doc)
        st = self._seqs[id(seq)] = _SeqState(seq, store, doc, tail, len(seq.completion_ids), self._calls)
        return st

    def _state(self, seq: Sequence) -> _SeqState:
        st = self._seqs.get(id(seq))
        if st is None or st.seq is not seq:  # begin() not called, or a recycled id()
            if st is not None:
                self._release(st)
            st = self._new_state(seq)
        st.last_used = self._calls
        return st

    def _sync(self, st: _SeqState) -> None:
        comp = st.seq.completion_ids
        if st.seen < len(comp):
            st.store.index.extend(st.doc, comp[st.seen:])
            st.seen = len(comp)

    def _release(self, st: _SeqState) -> None:
        """Forget a sample that will never finish (its generate call failed)."""
        st.store.live.discard(st.doc)
        st.store.index.remove(st.doc)
        st.store.evicted = True

    def _drop_stale(self) -> None:
        """Bound live states: a generate call that raised never finishes its samples."""
        if len(self._seqs) <= self.max_live:
            return
        for key, st in sorted(self._seqs.items(), key=lambda kv: kv[1].last_used)[:len(self._seqs) - self.max_live]:
            self._release(st)
            del self._seqs[key]

    def _trim_prompts(self) -> None:
        """LRU: forget whole prompts (never one with live samples) while over count or token budget."""
        held = sum(s.index.num_tokens for s in self._prompts.values())
        for key in list(self._prompts):
            if len(self._prompts) <= self.max_prompts and held <= self.history_tokens:
                break
            store = self._prompts[key]
            if not store.live:
                held -= store.index.num_tokens
                del self._prompts[key]

    # ---- drafting -----------------------------------------------------------------------------
    def _draft(self, st: _SeqState, m: int, width: int) -> Draft:
        tail = context_tail(st.seq, self.anchors[0])
        local = st.store.index
        for ai in range(len(self.anchors)):
            addrs, src = local.find(tail, ai, self.max_matches), local
            if not addrs:
                addrs, src = self._global.find(tail, ai, self.max_matches), self._global
            if addrs:
                break
        else:
            return Draft()
        conts = [src.continuation(a, m, periodic=src is local and a >> _SHIFT == st.doc) for a in addrs]
        return best_first(conts, m, width, self.min_prob)


def best_first(conts: list[list[int]], m: int, width: int, min_prob: float = 0.0) -> Draft:
    """A draft tree from continuations (newest first): count-weighted trie, grown best-first.

    A node's count / len(conts) is the empirical probability of its path; nodes are added in
    decreasing count (ties: shallower, then newer), each bringing its top-`width` children into
    play, so parents always precede children and no node has more than `width` children.
    """
    root: list = [0, {}]  # node = [count, {token: node}]
    for cont in conts:
        node = root
        for tok in cont:
            child = node[1].get(tok)
            if child is None:
                child = node[1][tok] = [0, {}]
            child[0] += 1
            node = child
    floor = min_prob * len(conts)
    tokens: list[int] = []
    parents: list[int] = []
    heap: list = []  # (-count, push order, token, node, parent index)
    order = itertools.count()

    def expose(node: list, index: int) -> None:
        for tok, child in sorted(node[1].items(), key=lambda kv: -kv[1][0])[:width]:  # stable: newer wins ties
            heapq.heappush(heap, (-child[0], next(order), tok, child, index))

    expose(root, -1)
    while heap and len(tokens) < m and -heap[0][0] >= floor:
        _, _, tok, node, parent = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        expose(node, len(tokens) - 1)
    return Draft(tokens, parents)
