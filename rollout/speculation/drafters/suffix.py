"""Suffix drafting: propose what followed the context's suffix in this prompt's other rollouts.

A GRPO group samples one prompt n times, and a prompt returns every epoch, so the best evidence
for how a sample continues is how its siblings (live right now) and its earlier rollouts went on
from the same words (the idea of SuffixDecoding, Seer and RhymeRL). Sources, per query:

- local (one `NgramIndex` per prompt while it has live samples): the prompt itself, every live
  sample of the prompt (indexed as it grows, so a sibling ahead is found; a sample's own earlier
  text counts, its own end cannot match itself) and up to `history_per_prompt` finished samples;
- global: the last `global_docs` finished samples of any prompt (shared boilerplate, formats).

Query: the longest suffix of the context found (anchor lengths from longest to shortest; at equal
length the local index wins), up to `max_matches` newest occurrences. Each continuation is cut to
spec_factor x its match length (a long match earns a long draft). They make a count-weighted
trie; the draft grows best-first by path count (the empirical probability of the path) taking at
most `width` children per node, until `max_tokens` nodes or until the best remaining path falls
under `min_prob` of the matches. Width 1 gives the most frequent path.

Memory is bounded. An index costs ~300 bytes a token, raw tokens 4: so a prompt's history is kept
cold (token arrays only) between its visits and indexed again when it returns (a few ms per
group). Bounds: finished samples per prompt (FIFO), prompts remembered (LRU by count and by
tokens; prompts with live samples are kept), the global window (by samples and by tokens).
"""
from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from rlspec.rollout.speculation.checkpoint import pack_arrays, unpack_arrays
from rlspec.rollout.speculation.drafters.base import DRAFTERS, Draft
from rlspec.rollout.speculation.drafters.ngram import NgramIndex, context_tail, measured_far_enough, tail_key
from rlspec.rollout.runtime.sequence import Sequence


@dataclass
class _PromptStore:
    prompt: array
    history: deque = field(default_factory=deque)  # finished samples: (prompt tail + completion, tail)
    tokens: int = 0  # prompt + history tokens: what the LRU budget counts
    index: NgramIndex | None = None  # prompt + history + live samples, while any sample is live
    live: set[int] = field(default_factory=set)  # index doc ids of samples still generating


@dataclass
class _SeqState:
    seq: Sequence
    store: _PromptStore
    doc: int
    tail: int  # prompt tokens copied in front of the completion in the doc
    seen: int  # completion tokens indexed so far
    last_used: int  # propose call counter, to drop states a failed generate left behind


class SuffixDrafter:
    """Suffix lookup over siblings, earlier rollouts of the prompt, recent rollouts and the prompt."""

    name = "suffix"

    def __init__(self, anchors: tuple[int, ...] = (8, 5, 3, 2), max_matches: int = 16, min_prob: float = 0.1,
                 spec_factor: float = 1.0, max_match: int = 32, history_per_prompt: int = 16,
                 max_prompts: int = 4096, history_tokens: int = 4_194_304, global_docs: int = 256,
                 global_tokens: int = 65_536, max_live: int = 4096):
        self.anchors = tuple(sorted(set(anchors), reverse=True))
        self.max_matches, self.min_prob = max_matches, min_prob
        self.spec_factor, self.max_match = spec_factor, max(max_match, self.anchors[0])
        self.history_per_prompt, self.max_prompts, self.history_tokens = history_per_prompt, max_prompts, history_tokens
        self.global_docs, self.global_tokens, self.max_live = global_docs, global_tokens, max_live
        self._prompts: OrderedDict[int, _PromptStore] = OrderedDict()  # hash(prompt) -> store, LRU oldest first
        self._held = 0  # sum of store.tokens
        self._global = NgramIndex(self.anchors)
        self._global_fifo: deque[int] = deque()
        # finished samples not yet in the global window: indexing one (and evicting the oldest) is ~1-3 ms for a
        # 500-token sample, so the engine has it done while the device runs a step (`settle`), not on the host's
        # path between two steps
        self._unsettled: deque[tuple[array, int]] = deque()
        self._seqs: dict[int, _SeqState] = {}  # id(seq) -> state; dropped at finish
        self._calls = 0

    # ---- the protocol -------------------------------------------------------------------------
    def begin(self, groups: list[list[Sequence]]) -> None:
        for st in [st for st in self._seqs.values() if st.seq.finished]:  # finished without finish()
            self.finish(st.seq)
        self.settle()  # new prompts start with every finished sample in the window
        for group in groups:
            for seq in group:
                if not seq.finished:  # a first token can end a sample before any step
                    self._state(seq)
        self._drop_stale()
        self._trim_prompts()

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        self._calls += 1
        states = [self._state(s) for s in seqs]
        for st in states:  # index every live sample's new tokens before any query sees its siblings
            self._sync(st)
        return [self._draft(st, m, width) if m > 0 else Draft() for st, m in zip(states, max_tokens)]

    def abandon(self, seq: Sequence) -> None:
        """A partial round stopped seq unfinished: its text is no history (a later round finishes it)."""
        st = self._seqs.pop(id(seq), None)
        if st is not None:
            self._unpin(st.store, st.doc)

    def finish(self, seq: Sequence) -> None:
        st = self._state(seq)
        self._sync(st)
        del self._seqs[id(seq)]
        store = st.store
        doc = store.index.tokens_of(st.doc)  # stays in the hot index; the history shares the array
        store.history.append((doc, st.tail))
        store.tokens += len(doc)
        self._held += len(doc)
        while len(store.history) > self.history_per_prompt:  # the hot index keeps it until it cools
            old, _ = store.history.popleft()
            store.tokens -= len(old)
            self._held -= len(old)
        self._unpin(store, st.doc)
        self._unsettled.append((doc, st.tail))
        self._trim_prompts()

    def settle(self) -> None:
        """Index the samples finished since the last call in the global window, evicting the oldest past its bounds
        (the engine calls it once a step's device work is launched; until then the window lags by those samples:
        their own prompt's index has them already)."""
        while self._unsettled:
            doc, tail = self._unsettled.popleft()
            self._global_fifo.append(self._global.add(doc, start=tail))
            while self._global_fifo and (len(self._global_fifo) > self.global_docs
                                         or self._global.num_tokens > self.global_tokens):
                self._global.remove(self._global_fifo.popleft())

    def sizes(self) -> dict[str, int]:
        """What the drafter holds now (all bounded by the constructor's limits)."""
        self.settle()
        return {"prompts": len(self._prompts), "prompt_tokens": self._held,
                "hot_prompts": sum(s.index is not None for s in self._prompts.values()),
                "global_docs": len(self._global_fifo), "global_tokens": self._global.num_tokens,
                "live_samples": len(self._seqs)}

    def state_dict(self) -> dict:
        """The history, for checkpoints: every remembered prompt (LRU order) with its finished
        samples, and the global window's samples (FIFO order), as packed token arrays. Indexes are
        not saved: a prompt's is rebuilt from its history on its next visit, as between any two
        visits, and the global one is rebuilt by re-adding its samples in order, which gives the
        same matches (its chains stop at removed samples either way). Taken between generate()
        calls; samples a failed call left unfinished are not history and are not saved."""
        self.settle()
        stores = list(self._prompts.items())
        docs = []
        for _, store in stores:
            docs += [store.prompt] + [doc for doc, _ in store.history]
        glob = [self._global.docs[d] for d in self._global_fifo]
        return {"prompts": [[key, store.tokens, [tail for _, tail in store.history]] for key, store in stores],
                "docs": pack_arrays(docs), "held": self._held, "calls": self._calls,
                "global": pack_arrays([d.tokens for d in glob]), "global_starts": [d.start for d in glob]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the history with a state_dict()'s (live samples of this drafter are dropped)."""
        docs = iter(unpack_arrays(state["docs"]))
        self._prompts, self._seqs = OrderedDict(), {}
        for key, tokens, tails in state["prompts"]:
            store = self._prompts[int(key)] = _PromptStore(next(docs), tokens=int(tokens))
            store.history.extend((next(docs), int(tail)) for tail in tails)
        self._held, self._calls = int(state["held"]), int(state["calls"])
        self._global, self._global_fifo, self._unsettled = NgramIndex(self.anchors), deque(), deque()
        for toks, start in zip(unpack_arrays(state["global"]), state["global_starts"]):
            self._global_fifo.append(self._global.add(toks, start=int(start)))

    # ---- bookkeeping --------------------------------------------------------------------------
    def _store(self, prompt: list[int]) -> _PromptStore:
        """The prompt's store, made hot: indexed prompt and history, ready for live samples."""
        key = hash(tuple(prompt))
        store = self._prompts.get(key)
        if store is None or store.prompt.tolist() != prompt:  # new, or a hash collision: start over
            if store is not None:
                self._held -= store.tokens
            store = self._prompts[key] = _PromptStore(array("i", prompt), tokens=len(prompt))
            self._held += len(prompt)
        self._prompts.move_to_end(key)
        if store.index is None:
            store.index = NgramIndex(self.anchors)
            store.index.add(store.prompt)
            for doc, tail in store.history:  # oldest first, so chains meet the newest first
                store.index.add(doc, start=tail)
        return store

    def _unpin(self, store: _PromptStore, doc: int) -> None:
        store.live.discard(doc)
        if not store.live:  # cold: keep the raw tokens, drop the index (~75x their size)
            store.index = None

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
                self._unpin(st.store, st.doc)
            st = self._new_state(seq)
        st.last_used = self._calls
        return st

    def _sync(self, st: _SeqState) -> None:
        comp = st.seq.completion_ids
        if st.seen < len(comp):
            st.store.index.extend(st.doc, comp[st.seen:])
            st.seen = len(comp)

    def _drop_stale(self) -> None:
        """Bound live states: a generate call that raised never finishes its samples."""
        if len(self._seqs) <= self.max_live:
            return
        for key, st in sorted(self._seqs.items(), key=lambda kv: kv[1].last_used)[:len(self._seqs) - self.max_live]:
            self._unpin(st.store, st.doc)
            del self._seqs[key]

    def _trim_prompts(self) -> None:
        """LRU: forget whole prompts (never one with live samples) while over count or token budget."""
        if not self._over_budget():
            return
        for key in list(self._prompts):
            store = self._prompts[key]
            if not store.live:
                self._held -= store.tokens
                del self._prompts[key]
                if not self._over_budget():
                    return

    def _over_budget(self) -> bool:
        return len(self._prompts) > self.max_prompts or self._held > self.history_tokens

    # ---- drafting -----------------------------------------------------------------------------
    def _draft(self, st: _SeqState, m: int, width: int) -> Draft:
        # measured no further than earns the whole budget: a long match (siblings sharing a long stretch) cost a
        # comparison a token up to max_match, for each of the matches
        enough = measured_far_enough(m, self.spec_factor, self.max_match)
        tail = context_tail(st.seq, max(enough, self.anchors[0]))
        local, glob = st.store.index, self._global
        for ai, a in enumerate(self.anchors):  # longest first; at one length the prompt's own index first
            key = tail_key(tail, a)  # both indexes key an n-gram alike: hashed once, looked up in each
            if key is None:
                continue
            # no document leaves a prompt's index (only the global window evicts), so a key it holds has matches
            src = local if key in local.head[ai] else glob
            addrs = src.find_key(key, ai, self.max_matches)
            if addrs:
                break
        else:
            return Draft()
        conts = []
        for a in addrs:
            # a longer match earns a longer draft (SuffixDecoding's max_spec_factor); a local match
            # reaching its document's start goes on through the prompt both texts share
            matched = src.match_len(a, tail, enough)  # == position: the match reaches the document's start
            if src is local and matched == src.position_of(a):
                matched = self.max_match
            n = min(m, math.ceil(self.spec_factor * matched))
            conts.append(src.continuation(a, n, periodic=src is local and src.doc_of(a) == st.doc))
        return best_first(conts, m, width, self.min_prob)


def best_first(conts: list[list[int]], m: int, width: int, min_prob: float = 0.0) -> Draft:
    """A draft tree from continuations (newest first): count-weighted trie, grown best-first.

    A node's count / len(conts) is the empirical probability of its path; nodes are added in
    decreasing count (ties: shallower, then newer), each bringing its top-`width` children into
    play, so parents always precede children and no node has more than `width` children.
    """
    floor = min_prob * len(conts)
    if width == 1:  # the heap would hold one node at a time: the most frequent path, followed directly
        return Draft.chain(_likeliest_path(conts, m, floor))
    root: list = [0, {}]  # node = [count, {token: node}]
    for cont in conts:
        node = root
        for tok in cont:
            child = node[1].get(tok)
            if child is None:
                child = node[1][tok] = [0, {}]
            child[0] += 1
            node = child
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


def _likeliest_path(conts: list[list[int]], m: int, floor: float) -> list[int]:
    """best_first's chain (width 1): at each depth the token most continuations still on the path agree on (ties: the
    newest, the first seen), while at least `floor` of them do, up to m tokens."""
    path: list[int] = []
    while len(path) < m:
        d, counts = len(path), {}
        for c in conts:
            if len(c) > d:
                counts[c[d]] = counts.get(c[d], 0) + 1
        if not counts:
            break
        tok = max(counts, key=counts.__getitem__)  # the first of the most frequent, in the continuations' order
        if counts[tok] < floor:
            break
        path.append(tok)
        conts = [c for c in conts if len(c) > d and c[d] == tok]
    return path


@DRAFTERS.register("suffix", learned=False, auto=True)
def _build(target=None, spec=None, **overrides) -> SuffixDrafter:
    """Model-free: needs neither the target nor the SpecConfig."""
    return SuffixDrafter(**overrides)
