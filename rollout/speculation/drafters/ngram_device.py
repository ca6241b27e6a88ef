"""Prompt lookup on the device: the n-gram drafter's chains, looked up where the model runs (as vLLM's ngram_gpu).

The host n-gram drafter (ngram.py) keeps a hash index per sample in Python and looks a row up after the host has
read a step: ~10 us a row, so at the batch sizes RL runs (64-512) 1-5 ms a step that the device idles through
(docs/runtime.md#host-step-budget). Here every live sample's tokens sit in one [slots, length] int32 buffer on the
engine's device. A proposal sends what the host committed since the last one (a few tokens a row, in one copy through
the decode loop's funnel, runtime/transfers.py) and looks every row up at once in fixed shapes: on CUDA one graph per
row bucket, context bucket and draft length. The drafts stay on the device (`DraftTensors`) for the verify.

The lookup, for a row of n tokens t[0..n-1] and A = max_ngram: each candidate p in [1, n - 1] (a draft starting at
t[p]) has run(p), how many of t[p-1], t[p-2], .., t[p-A] equal t[n-1], t[n-2], .., t[n-A] in a row (nothing before
t[0] matches). The row drafts from the p that maximises (min(run(p), A), p): the longest matching suffix, then its
newest occurrence, which is the host drafter's order (anchors longest first, each newest first). The draft is
t[p + j mod (n - p)] for j < m: the continuation, periodic where it runs into the row's end, as the host drafter's.
Where the host drafter drafts (a match of at least min_ngram tokens), the chains are the same
(tests/rollout/speculation/test_ngram_device.py).

What differs: the host reads a draft only as the verify's outcome, so it never learns whether a row matched, and
every row drafts its budget. A row without a match of min_ngram tokens drafts from its best shorter one, a repeat of
its last token when there is none (which repeated text often continues); verification rejects what is wrong, which
costs the verify's compute, never exactness. Chains only: a tree needs the matches' counts (ngram.py).
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.graphs import GraphSet, bucket_for, pow2_buckets
from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.speculation.drafters.base import DRAFTERS, Draft, DraftTensors
from rlspec.rollout.speculation.drafters.eagle3_graphs import GRAPH_MODES, row_bucket

MIN_CONTEXT = 64  # the smallest context bucket a lookup runs over (then powers of two up to the cache's length)


def lookup(tokens: torch.Tensor, lens: torch.Tensor, max_ngram: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's draft at once. tokens [B, L] int: row i's tokens at 0..lens[i]-1 (what lies past is never read);
    lens [B] long, 1 <= lens <= L. Returns (drafts [B, D] long, the matched suffix's length [B], at most max_ngram)."""
    B, L = tokens.shape
    A, dev = max_ngram, tokens.device
    padded = torch.cat([tokens.new_full((B, A), -1), tokens], 1)  # padded[:, A + i] = t[i]; before t[0]: -1
    p = torch.arange(L + 1, device=dev)  # candidates (p = 0 and p >= n are never chosen, below)
    run = torch.zeros(B, L + 1, dtype=torch.int32, device=dev)
    alive = torch.ones(B, L + 1, dtype=torch.bool, device=dev)
    for k in range(1, A + 1):  # t[p - k] == t[n - k] while every nearer pair matched
        tail = padded.gather(1, (lens + A - k)[:, None])  # t[n - k]; -1 before t[0], which nothing may match
        tail = tail.masked_fill(tail < 0, -2)
        alive &= padded[:, A - k:A - k + L + 1] == tail
        run += alive
    valid = (p >= 1) & (p < lens[:, None])  # a continuation token exists, and the row's own end is no match
    score = torch.where(valid, run * (L + 1) + p.int(), -1)  # longest first, then newest (run <= A: no overflow)
    top, start = score.max(1)
    matched = torch.div(top, L + 1, rounding_mode="floor").clamp(min=0)
    start = torch.where(top >= 0, start, lens - 1)  # n = 1, no candidate: the last token repeated
    period = lens - start
    at = start[:, None] + torch.arange(D, device=dev) % period[:, None]
    return tokens.gather(1, at).long(), matched


class DeviceNgramDrafter:
    """Prompt lookup decoding (chains) with the lookup on the device (module docstring)."""

    name = "ngram_device"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, graph_mode: str = "auto"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        # min_ngram is what the host drafter needs to draft; here it only tells `matched` rows apart (drafts_matched)
        self.max_ngram, self.min_ngram, self.graph_mode = max_ngram, min_ngram, graph_mode
        self.cache = None  # the engine's PagedKVCache, given at each start(): device, lengths, the funnel
        self.buf: torch.Tensor | None = None  # [slots, length] int32: each live sample's tokens
        self._state: dict[int, list] = {}  # id(seq) -> [seq, slot, tokens written]
        self._free: list[int] = []  # slots released in this call (below _used)
        self._used = 0  # slots handed out in this call
        self.graphs: GraphSet | None = None
        self._frames: dict[tuple, tuple] = {}  # graph key -> static (inputs [2, r], drafts [r, D], matched [r]), long
        self.last_matched: torch.Tensor | None = None  # [B]: the last proposal's matched lengths (tests, metrics)

    # ---- the engine's hooks ---------------------------------------------------------------------
    def start(self, seqs, cache, params=None, generator=None, history=None) -> None:
        """A generate call begins: nothing outlives a call (each sample looks up only its own text)."""
        self.cache, self._state, self._free, self._used = cache, {}, [], 0
        if self.buf is None or self.buf.device != cache.table.device or self.buf.shape[1] < cache.length:
            self._resize(max(cache.rows, 1), cache.length)

    def begin(self, groups: list[list[Sequence]]) -> None:
        for key in [k for k, st in self._state.items() if st[0].finished]:  # finished without finish()
            self._release(key)

    def finish(self, seq: Sequence) -> None:
        self._release(id(seq))

    abandon = finish  # a partial round's unfinished sample: its slot goes, as at the end

    def state_dict(self) -> dict:
        """Nothing outlives a generate() call (kept so that checkpoints say so explicitly)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        self._state, self._free, self._used = {}, [], 0

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        return self.propose_tensors(seqs, max_tokens, width).to_drafts()

    def propose_tensors(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> DraftTensors:
        """Every row's chain of max_tokens[i] tokens, on the device (`width` > 1 drafts chains all the same)."""
        D = max(max_tokens, default=0)
        if D == 0:
            return DraftTensors(torch.zeros(len(seqs), 1, 0, dtype=torch.long, device=self._device()), None,
                                list(max_tokens))
        if self.cache is None:
            raise RuntimeError("ngram_device drafts inside an engine's generate call (its start() gives the device "
                               "and the funnel); use drafter='ngram' to propose outside one")
        r = row_bucket(len(seqs))
        slots, lens, writes = self._sync(seqs, r)
        top = max(lens)
        L = bucket_for(top, pow2_buckets(MIN_CONTEXT, self.buf.shape[1])) or top
        packed = self.cache.ints(slots + lens + [x for w in writes for x in w])
        W = len(writes[0])
        if W:  # the tokens committed since the last proposal
            at = packed[2 * r:].view(3, W)
            self.buf[at[0], at[1]] = at[2].to(self.buf.dtype)
        drafts, matched = self._lookup(packed[:2 * r].view(2, r), L, D)
        self.last_matched = matched[:len(seqs)]
        return DraftTensors(drafts[:len(seqs), None, :], None, list(max_tokens))

    # ---- internals ------------------------------------------------------------------------------
    def _sync(self, seqs: list[Sequence], r: int) -> tuple[list[int], list[int], tuple[list, list, list]]:
        """Each row's slot and length, padded to r rows (slot 0, length 1: read, never used), and the (slot,
        position, token) of every token not yet in the buffer."""
        slots, lens, ws, wp, wt = [], [], [], [], []
        state = self._state
        for s in seqs:
            st = state.get(id(s))
            if st is None or st[0] is not s:  # first proposal for it (or a recycled id())
                st = state[id(s)] = [s, self._take_slot(), 0]
            n = s.cache_len + 1
            if st[2] < n:
                new = s.ids(st[2], n)
                ws += [st[1]] * len(new)
                wp += range(st[2], n)
                wt += new
                st[2] = n
            slots.append(st[1])
            lens.append(n)
        if max(lens) > self.buf.shape[1]:
            self._resize(self.buf.shape[0], max(lens))
        pad = r - len(seqs)
        return slots + [0] * pad, lens + [1] * pad, (ws, wp, wt)

    def _lookup(self, inputs: torch.Tensor, L: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`lookup` over the buffer's rows `inputs[0]` of lengths `inputs[1]`: eagerly, or replayed from a graph."""
        graphs = self.graph_set()
        if graphs is None:
            return lookup(self.buf[inputs[0], :L], inputs[1], self.max_ngram, D)
        key = (inputs.shape[1], L, D)
        frame = self._frames.get(key)
        if frame is None:  # static buffers outside the graphs' pool: no later capture reuses their memory
            r = inputs.shape[1]
            frame = self._frames[key] = (torch.empty_like(inputs), inputs.new_empty(r, D), inputs.new_empty(r))
        static, drafts, matched = frame
        static.copy_(inputs)

        def run():  # reads only the frame's inputs and the buffer; writes the frame's outputs
            got = lookup(self.buf[static[0], :L], static[1], self.max_ngram, D)
            drafts.copy_(got[0])
            matched.copy_(got[1])

        graphs.replay(key, run)
        return drafts, matched

    def graph_set(self) -> GraphSet | None:
        """The lookup's graphs (made on first use), or None where it runs eagerly."""
        if self.graph_mode == "off":
            return None
        if self.graphs is None:
            device = self._device()
            if self.graph_mode == "emulate":
                self.graphs = GraphSet(device, "emulate")
            elif device.type == "cuda":
                self.graphs = GraphSet(device, "cuda")
        return self.graphs

    def _resize(self, slots: int, length: int) -> None:
        """A buffer of at least these slots and positions, keeping what it holds; graphs read the old one's address,
        so they go with it."""
        device = self.cache.table.device
        old = self.buf
        self.buf = torch.zeros(slots, length, dtype=torch.int32, device=device)
        if old is not None and old.device == device:
            n, m = min(old.shape[0], slots), min(old.shape[1], length)
            self.buf[:n, :m] = old[:n, :m]
        if self.graphs is not None:
            self.graphs.graphs.clear()
        self._frames = {}

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._used == self.buf.shape[0]:  # more samples under way than the cache has rows (preempted ones)
            self._resize(2 * self._used, self.buf.shape[1])
        self._used += 1
        return self._used - 1

    def _release(self, key: int) -> None:
        st = self._state.pop(key, None)
        if st is not None:
            self._free.append(st[1])

    def _device(self) -> torch.device:
        return self.cache.table.device if self.cache is not None else torch.device("cpu")


@DRAFTERS.register("ngram_device", learned=False, auto=False)
def _build(target=None, spec=None, **overrides) -> DeviceNgramDrafter:
    """Model-free; chains only (SpecConfig.tree_width 1)."""
    if spec is not None and spec.tree_width > 1:
        raise ValueError(f"drafter ngram_device drafts chains; tree_width={spec.tree_width} asks for trees: set "
                         "drafter.tree_width=1, or use drafter=ngram (trees from the matches' counts, on the host)")
    return DeviceNgramDrafter(**overrides)
