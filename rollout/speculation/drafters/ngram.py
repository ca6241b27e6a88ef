"""N-gram drafting: a compact n-gram index over token documents, and prompt lookup decoding.

`NgramIndex` is shared with the suffix drafter. It indexes, for a few anchor lengths a, every a-gram
of its documents as a zlib-style hash chain: `head[a][key(a-gram)]` holds the address of the
newest occurrence (the position right after it, where its continuation starts) and `prev[a][p]`
the address of the previous one. Walking a chain yields matches newest first. Memory is an
8-byte array slot per token and anchor plus one dict entry per distinct a-gram, with no list per
occurrence: about 250 bytes a token with four anchors. A key is the n-gram's tokens packed into one
integer, 32 bits each, the last token lowest (`gram_key`), so a document carries the key of its last
tokens from one token to the next with a shift, and every shorter anchor's key is a mask of it: no
tuple is built or hashed per token. Keys are exact for token ids below 2^32.

`NgramDrafter` is prompt lookup decoding: each sequence looks up its own prompt + completion for
earlier occurrences of its last n tokens (n from max_ngram down to min_ngram) and proposes what
followed the newest one.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

from rlspec.rollout.speculation.drafters.base import DRAFTERS, NO_DRAFT, Draft
from rlspec.rollout.runtime.sequence import Sequence

_SHIFT = 24  # an address is doc_id << _SHIFT | position: documents up to 16M tokens
_MASK = (1 << _SHIFT) - 1
_BITS = 32  # a key's bits per token (gram_key)


class _Doc:
    __slots__ = ("tokens", "prev", "start", "key", "levels")

    def __init__(self, index: "NgramIndex", start: int):
        self.tokens = array("i")  # 4 bytes a token; histories can hold hundreds of thousands
        self.prev = [array("q") for _ in index.anchors]  # per anchor, one slot per position
        self.start = start  # first position whose a-grams are indexed (skips a copied prompt tail)
        self.key = 0  # gram_key of the last tokens, as many as the longest anchor (fewer at the start)
        self.levels = tuple(zip(index.head, self.prev, index.masks, index.anchors))  # what extend walks


class NgramIndex:
    """Documents of tokens with newest-first lookup of the positions that follow an n-gram."""

    def __init__(self, anchors: tuple[int, ...]):
        self.anchors = tuple(sorted(set(anchors), reverse=True))  # longest first
        if not self.anchors or self.anchors[-1] < 1:
            raise ValueError(f"anchor lengths must be >= 1, got {anchors}")
        self.masks = tuple((1 << _BITS * a) - 1 for a in self.anchors)  # an a-gram's key: the longest's, masked
        self.head: list[dict[int, int]] = [{} for _ in self.anchors]
        self.docs: dict[int, _Doc] = {}
        self.num_tokens = 0
        self._next_id = 0  # never reused, so an address into a removed document stays dead

    @staticmethod
    def doc_of(addr: int) -> int:
        return addr >> _SHIFT

    @staticmethod
    def position_of(addr: int) -> int:
        return addr & _MASK

    def tokens_of(self, doc_id: int) -> array:
        return self.docs[doc_id].tokens

    def add(self, tokens, start: int = 0) -> int:
        """A new document; positions before `start` only serve as left context of later n-grams."""
        doc_id = self._next_id
        self._next_id += 1
        self.docs[doc_id] = _Doc(self, start)
        self.extend(doc_id, tokens)
        return doc_id

    def extend(self, doc_id: int, tokens) -> None:
        """Append tokens to a (live) document and index the n-grams they complete."""
        doc = self.docs[doc_id]
        toks = doc.tokens
        old = len(toks)
        toks.extend(tokens)
        n = len(toks)
        self.num_tokens += n - old
        base, start, key, keep = doc_id << _SHIFT, doc.start, doc.key, self.masks[0]
        # position p is indexed once token p exists: the n-gram ending at the document's last token has no
        # continuation yet, so a sequence never matches itself at its own end. `key` holds the n-gram before p.
        # (Operators rather than calls in this loop: it runs per token and anchor, every decode step, for every row;
        # a step brings a row one to a few tokens.)
        for p in range(old, n):
            for head, prev, mask, a in doc.levels:
                if p >= a and p >= start:
                    k = key & mask
                    prev.append(head.get(k, -1))
                    head[k] = base | p
                else:  # no earlier occurrence
                    prev.append(-1)
            key = (key << _BITS | toks[p]) & keep
        doc.key = key

    def remove(self, doc_id: int) -> None:
        """Drop a document; chain heads pointing into it move to the next live occurrence."""
        doc = self.docs.pop(doc_id)
        self.num_tokens -= len(doc.tokens)
        key, keep = 0, self.masks[0]
        for p, tok in enumerate(doc.tokens):
            for head, prev, mask, a in doc.levels:
                if p < a or p < doc.start:
                    continue
                k = key & mask
                addr = head.get(k, -1)
                if addr < 0 or addr >> _SHIFT != doc_id:
                    continue
                while addr >= 0 and addr >> _SHIFT == doc_id:
                    addr = prev[addr & _MASK]
                if addr >= 0 and addr >> _SHIFT in self.docs:
                    head[k] = addr
                else:  # older entries sit in removed documents: the chain is gone
                    del head[k]
            key = (key << _BITS | tok) & keep

    def find(self, context: list[int], ai: int, limit: int) -> list[int]:
        """Addresses of up to `limit` occurrences of context's last anchors[ai] tokens, newest first."""
        key = tail_key(context, self.anchors[ai])
        return [] if key is None else self.find_key(key, ai, limit)

    def find_end(self, doc_id: int, limit: int) -> list[int]:
        """find for a document's own end, at the longest anchor that occurred before (its key is at hand: no tail
        to read): up to `limit` addresses, newest first ([]: none has)."""
        doc = self.docs[doc_id]
        n, key = len(doc.tokens), doc.key
        for ai, (mask, a) in enumerate(zip(self.masks, self.anchors)):
            addrs = self.find_key(key & mask, ai, limit) if n >= a else None
            if addrs:
                return addrs
        return []

    def find_key(self, key: int, ai: int, limit: int) -> list[int]:
        """find by the n-gram's key (`tail_key`: a query of several indexes with these anchors packs it once). A
        chain stops at a removed document: eviction is (mostly) oldest first, so little is lost."""
        addr = self.head[ai].get(key, -1)
        out, docs = [], self.docs
        while addr >= 0 and len(out) < limit:
            doc = docs.get(addr >> _SHIFT)
            if doc is None:
                break
            out.append(addr)
            addr = doc.prev[ai][addr & _MASK]
        return out

    def match_len(self, addr: int, context, cap: int) -> int:
        """How many tokens before `addr` equal context's last ones (at most cap, at least the anchor)."""
        toks = self.docs[addr >> _SHIFT].tokens
        p, n = addr & _MASK, 0
        limit = min(cap, p, len(context))
        while n < limit and toks[p - 1 - n] == context[-1 - n]:
            n += 1
        return n

    def continuation(self, addr: int, n: int, periodic: bool = False) -> list[int]:
        """Up to n tokens from address `addr` on. periodic: a match that runs into the document's
        end is a repeating pattern (its period is the distance to the end); continue it."""
        toks = self.docs[addr >> _SHIFT].tokens
        p = addr & _MASK
        out = toks[p:p + n].tolist()
        if periodic:
            period = len(toks) - p
            while len(out) < n:
                out.append(out[len(out) - period])
        return out


def gram_key(tokens) -> int:
    """The index key of these tokens (an n-gram): 32 bits a token, the last lowest."""
    key = 0
    for t in tokens:
        key = key << _BITS | t
    return key


def tail_key(context: list[int], a: int) -> int | None:
    """The index key of context's last a tokens, as `extend` keys each n-gram (None: context is shorter)."""
    return gram_key(context[-a:]) if len(context) >= a else None


def measured_far_enough(m: int, spec_factor: float | None, max_match: int) -> int:
    """How far a match need be measured to size a draft of at most m tokens cut to ceil(spec_factor x its length):
    a match of ceil(m / spec_factor) tokens already earns all m (0: no spec_factor, the whole budget unmeasured)."""
    return min(max_match, math.ceil(m / spec_factor)) if spec_factor and spec_factor > 0 else 0


def context_tail(seq: Sequence, n: int) -> list[int]:
    """The last n tokens of prompt + completion, without copying the whole context."""
    comp = seq.completion_ids
    if len(comp) >= n:
        return comp[-n:]
    return seq.prompt_ids[-(n - len(comp)):] + comp


@dataclass
class _SeqIndex:
    seq: Sequence
    index: NgramIndex
    doc: int
    seen: int  # completion tokens indexed so far


class NgramDrafter:
    """Prompt lookup decoding over each sequence's own prompt + completion.

    Chain (width 1): the tokens that followed the newest earlier occurrence of the longest
    matching suffix (n from max_ngram down to min_ngram). Tree (width > 1): the root's children
    are the distinct tokens that followed the matches at that longest n (most frequent first,
    then newest), each continued as a chain from its newest match; the node budget is split
    evenly. Only equally long matches branch: shorter ones are weaker evidence.

    min_ngram defaults to 2. Replaying SmolLM2-135M rollouts (temperature 1, k=4): min_ngram=1
    drafts for 53% of steps with 0.09 tokens accepted per drafted token; min_ngram=2 drafts for 17%
    with 0.16 (0.27 with spec_factor=1). Unigram matches buy ~8% more tokens per step at batch 1
    but waste verify compute at large batch. spec_factor caps a draft at spec_factor x the match
    length (None: always the full budget, as classic prompt lookup does).
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, max_matches: int = 16,
                 spec_factor: float | None = None, max_match: int = 32):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.anchors = tuple(range(max_ngram, min_ngram - 1, -1))
        self.max_matches = max_matches
        self.spec_factor, self.max_match = spec_factor, max(max_match, max_ngram)
        self._seqs: dict[int, _SeqIndex] = {}  # id(seq) -> its index; dropped at finish

    def begin(self, groups: list[list[Sequence]]) -> None:
        for key in [k for k, st in self._seqs.items() if st.seq.finished]:  # finished without finish()
            del self._seqs[key]
        for group in groups:
            for seq in group:
                if not seq.finished:  # a first token can end a sample before any step
                    self._seqs[id(seq)] = self._new(seq)

    def finish(self, seq: Sequence) -> None:
        self._seqs.pop(id(seq), None)

    abandon = finish  # a partial round's unfinished sample: its index goes, as at the end

    def state_dict(self) -> dict:
        """Nothing outlives a generate() call: each sequence looks up only its own text, and its
        index is dropped when it finishes. (Kept so that checkpoints say so explicitly.)"""
        return {}

    def load_state_dict(self, state: dict) -> None:
        self._seqs = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        return [self._draft(self._sync(s), m, width) if m > 0 else NO_DRAFT for s, m in zip(seqs, max_tokens)]

    # ---- internals ----------------------------------------------------------------------------
    def _new(self, seq: Sequence) -> _SeqIndex:
        index = NgramIndex(self.anchors)
        return _SeqIndex(seq, index, index.add(seq.all_ids()), len(seq.completion_ids))

    def _sync(self, seq: Sequence) -> _SeqIndex:
        st = self._seqs.get(id(seq))
        if st is None or st.seq is not seq:  # begin() not called, or a recycled id()
            st = self._seqs[id(seq)] = self._new(seq)
        elif st.seen < len(seq.completion_ids):
            st.index.extend(st.doc, seq.completion_ids[st.seen:])
            st.seen = len(seq.completion_ids)
        return st

    def _draft(self, st: _SeqIndex, m: int, width: int) -> Draft:
        index = st.index
        addrs = index.find_end(st.doc, 1 if width == 1 else self.max_matches)  # the document: prompt + completion
        if not addrs:
            return NO_DRAFT
        if self.spec_factor:  # a longer match earns a longer draft
            enough = measured_far_enough(m, self.spec_factor, self.max_match)
            m = min(m, math.ceil(self.spec_factor * index.match_len(addrs[0], index.tokens_of(st.doc), enough)))
        if width == 1 or m == 1:
            return Draft.chain(index.continuation(addrs[0], m, periodic=True))
        return self._tree(index, addrs, m, width)

    def _tree(self, index: NgramIndex, addrs: list[int], m: int, width: int) -> Draft:
        firsts: dict[int, list[int]] = {}  # next token -> [count, newest address]
        for addr in addrs:
            tok = index.continuation(addr, 1, periodic=True)[0]
            entry = firsts.setdefault(tok, [0, addr])
            entry[0] += 1
        branches = sorted(firsts.values(), key=lambda e: -e[0])[:min(width, m)]  # stable: newest wins ties
        tokens: list[int] = []
        parents: list[int] = []
        for b, (_, addr) in enumerate(branches):
            size = m // len(branches) + (b < m % len(branches))
            start = len(tokens)
            tokens += index.continuation(addr, size, periodic=True)
            parents += [-1] + list(range(start, start + size - 1))
        return Draft(tokens, parents)


@DRAFTERS.register("ngram", learned=False, auto=True)
def _build(target=None, spec=None, **overrides) -> NgramDrafter:
    """Model-free: needs neither the target nor the SpecConfig."""
    return NgramDrafter(**overrides)
