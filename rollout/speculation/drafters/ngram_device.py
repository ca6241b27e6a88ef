"""Prompt lookup on the device: n-gram chains looked up where the model runs (as vLLM's ngram_gpu), in the sample's
own text, its siblings' and its prompt's earlier samples'.

The host drafters keep hash indexes in Python and look a row up after the host has read a step: ~10 us a row for
n-gram, ~30 for suffix, so at the batch sizes RL runs (64-512) milliseconds a step that the device idles through
(docs/runtime.md#host-step-budget). Here every sample's tokens sit in one [slots, length] int32 buffer on the
engine's device, with each slot's length and the slots of its group (the samples of its prompt, behind the prompt's
history: its last finished samples of earlier calls, `PromptHistory`, written when the group is admitted). A proposal
sends what the host committed since the last one (a few tokens a row, one copy through the decode loop's funnel,
runtime/transfers.py) and looks every row up at once in fixed shapes: on CUDA one graph per row bucket, context
bucket, group size and draft length. The drafts stay on the device (`DraftTensors`) for the verify.

The lookup, for a row whose own text is t[0..n-1], A = max_ngram, and each document d of its group (its own text and,
with `siblings`, each sibling's, live or finished, as far as the buffer holds it, and the history's texts): each
candidate p in [1, len(d) - 1] (a draft starting at d[p]) has run(p), how many of d[p-1], d[p-2], .., d[p-A] equal
t[n-1], t[n-2], .., t[n-A] in a row (nothing before d[0] matches). The row drafts from the candidate that maximises
(min(run, A), own text first, the later document, p): the longest matching suffix, then its newest occurrence (the
history's texts come first in a group, oldest first, so a sibling's wins a tie). The draft is d[p + j mod (len(d) -
p)] for j < m: the continuation, periodic where it runs into the document's end. With siblings off and no history,
the chain is the host n-gram drafter's wherever that one drafts (tests/rollout/speculation/test_ngram_device.py). On
64 SmolLM2 math rollouts (8 prompts x 8 samples, T = 1, three epochs) a 4-token draft at every position would be
accepted for 0.252 / 0.192 / 0.224 tokens a position from the sample's own text, 0.285 / 0.212 / 0.243 with its
siblings' and 0.285 / 0.243 / 0.275 with the prompt's history too (the suffix drafter: 0.226 / 0.211 / 0.251, drafting
at about half the positions; `python -m rlspec.bench drafter --part replay`, bench_out/drafter_replay.json).

What differs from the host drafters: the host reads a draft only as the verify's outcome, so it never learns whether
a row matched, and every row drafts its budget. A row without a match drafts from its best shorter one, a repeat of
its last token when there is none, and verification rejects what is wrong. A verify pads every row to the step's
longest draft, so such a draft costs nothing the step did not already run once any row drafts; what it costs is the
steps on which no row would have matched (plain steps for the host drafters). Chains only: a tree needs the
matches' counts (ngram.py, suffix.py). A lookup reads rows x group x context positions: ~25 bytes each in its
intermediates.
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.graphs import GraphSet, bucket_for, pow2_buckets
from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.speculation.drafters.base import DRAFTERS, Ahead, Draft, DraftTensors
from rlspec.rollout.speculation.drafters.eagle3_graphs import GRAPH_MODES, pow2_at_least, row_bucket
from rlspec.rollout.speculation.drafters.prompt_history import PromptHistory

MIN_CONTEXT = 64  # the smallest context bucket a lookup runs over (then powers of two up to the cache's length)


def lookup(docs: torch.Tensor, lens: torch.Tensor, own: torch.Tensor, max_ngram: int, D: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's draft at once. docs [B, G, L] int: the row's group's documents, document g's tokens at
    0..lens[b, g]-1 (what lies past is never read; lens 0: no document); own [B] long: which document is the row's
    own text (lens >= 1 there), whose end is the query. Returns (drafts [B, D] long, the matched suffix's length [B],
    at most max_ngram)."""
    B, G, L = docs.shape
    A, dev = max_ngram, docs.device
    lens = lens.clamp(max=L)  # a document past the context the caller gathered is read as far as it reaches
    padded = torch.cat([docs.new_full((B, G, A), -1), docs], 2)  # padded[..., A + i] = d[i]; before d[0]: -1
    rows = torch.arange(B, device=dev)
    n = lens[rows, own]
    mine = padded[rows, own]  # [B, A + L]: the row's own text
    p = torch.arange(L + 1, device=dev)  # candidates (p = 0 and p >= len(d) are never chosen, below)
    run = torch.zeros(B, G, L + 1, dtype=torch.int32, device=dev)
    alive = torch.ones(B, G, L + 1, dtype=torch.bool, device=dev)
    for k in range(1, A + 1):  # d[p - k] == t[n - k] while every nearer pair matched
        tail = mine.gather(1, (n + A - k)[:, None])  # t[n - k]; -1 before t[0], which nothing may match
        tail = tail.masked_fill(tail < 0, -2)
        alive &= padded[:, :, A - k:A - k + L + 1] == tail[:, :, None]
        run += alive
    valid = (p >= 1) & (p < lens[:, :, None])  # a continuation token exists (the row's own end is no match)
    g = torch.arange(G, dtype=torch.int32, device=dev)
    rank = 2 * G * run.clamp(max=A) + g[:, None] + G * (g == own[:, None])[:, :, None]  # longest, own, later g
    score = torch.where(valid, rank * (L + 1) + p.int(), -1).view(B, -1)
    top, at = score.max(1)
    doc, start = torch.div(at, L + 1, rounding_mode="floor"), at % (L + 1)
    matched = torch.where(top >= 0, run.view(B, -1).gather(1, at[:, None])[:, 0].clamp(max=A), 0)
    doc, start = torch.where(top >= 0, doc, own), torch.where(top >= 0, start, n - 1)  # nothing: the last token
    period = lens[rows, doc] - start
    pos = start[:, None] + torch.arange(D, device=dev) % period[:, None]
    return docs[rows, doc].gather(1, pos).long(), matched


class DeviceNgramDrafter:
    """Prompt lookup decoding (chains) over the sample's own text and its siblings', on the device (module
    docstring)."""

    name = "ngram_device"

    def __init__(self, max_ngram: int = 4, siblings: bool = True, history_per_prompt: int = 8,
                 history_prompts: int = 4096, history_tokens: int = 4_194_304, graph_mode: str = "auto"):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        self.max_ngram, self.siblings, self.graph_mode = max_ngram, siblings, graph_mode
        # the prompts' earlier rollouts (finished in earlier calls or this one), looked up beside the group's texts
        self.history = PromptHistory(history_per_prompt, history_prompts, history_tokens)
        self.cache = None  # the engine's PagedKVCache, given at each start(): device, lengths, the funnel
        # on the device: each slot's tokens, its length, and its group's slots (-1 past the group); the last slot is
        # a trash slot the padding rows of a lookup read and write
        self.buf = self.lens = self.members = None
        self._state: dict[int, list] = {}  # id(seq) -> [seq, slot, tokens written, its group's record]
        self._free: list[int] = []  # slots released in this call (below _used)
        self._used = 0  # slots handed out in this call
        self._longest = 0  # the longest text written in this call (every lookup reads that far)
        self.graphs: GraphSet | None = None
        self._frames: dict[tuple, tuple] = {}  # graph key -> static (inputs [2, r], drafts [r, D], matched [r]), long
        self.last_matched: torch.Tensor | None = None  # [B]: the last proposal's matched lengths (tests read them)

    # ---- the engine's hooks ---------------------------------------------------------------------
    def start(self, seqs, cache, params=None, generator=None, history=None) -> None:
        """A generate call begins: the buffers hold no sample (only the prompts' history outlives a call), and are
        made wide enough for the call's largest group with its prompt's history."""
        self.cache, self._state, self._free, self._used, self._longest = cache, {}, [], 0, 0
        groups = list(_groups_of(seqs)) if self.siblings else [[s] for s in seqs]
        earlier = [min(self.history.count(g[0].prompt_ids), self.history.per_prompt) for g in groups]
        width = max((len(g) + n for g, n in zip(groups, earlier)), default=1)
        rows = max(cache.rows, 1)
        # the rows' samples and, for the groups that fill them, their history (more slots, if ever, by growing)
        slots = rows + max(earlier, default=0) * min(len(groups), rows)
        if self.buf is None or self.buf.device != cache.table.device or self.buf.shape[1] < cache.length \
                or self.members.shape[1] < width or self.buf.shape[0] - 1 < slots:
            self._resize(slots, cache.length, width)

    def begin(self, groups: list[list[Sequence]]) -> None:
        for st in [st for st in self._state.values() if st[0].finished]:  # finished without finish()
            self.finish(st[0])
        self._register(groups if self.siblings else [[s] for g in groups for s in g])

    def finish(self, seq: Sequence) -> None:
        if seq.finished:  # the newest of its prompt's history (from the next group of that prompt on)
            self.history.add(seq.prompt_ids, seq.completion_ids)
        self._release(id(seq))

    def abandon(self, seq: Sequence) -> None:
        """A partial round stopped seq unfinished: its slot goes, and its text is no history (a later round ends
        it)."""
        self._release(id(seq))

    def state_dict(self) -> dict:
        """The prompts' history (no sample outlives a generate() call)."""
        return {"history": self.history.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._state, self._free, self._used = {}, [], 0
        self.history.load_state_dict(state.get("history", {}))

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        return self.propose_tensors(seqs, max_tokens, width).to_drafts()

    def propose_tensors(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> DraftTensors:
        """Every row's chain of max_tokens[i] tokens, on the device (`width` > 1 drafts chains all the same)."""
        D = max(max_tokens, default=0)
        if self.cache is None:
            raise RuntimeError("ngram_device drafts inside an engine's generate call (its start() gives the device "
                               "and the funnel); use drafter='ngram' to propose outside one")
        if D == 0:  # no row drafts: what the rows committed is sent with their next proposal
            self.last_matched = None
            return DraftTensors(self.buf.new_zeros(len(seqs), 1, 0, dtype=torch.long), None, list(max_tokens))
        r = row_bucket(len(seqs))
        packed, L = self._send(seqs, r)
        drafts, matched = self._lookup(packed[:2 * r].view(2, r), L, D)
        self.last_matched = matched[:len(seqs)]
        return DraftTensors(drafts[:len(seqs), None, :], None, list(max_tokens))

    def propose_ahead(self, seqs: list[Sequence], depth: int, ahead: Ahead) -> DraftTensors:
        """`depth` tokens a row (the verify takes each row's budget of them) for the step after one the host has not
        read (rollout/chains_ahead.py): each row's text on the device is extended there by that step's emitted tokens
        (the first accepted + 1 of them) as the host will append them (up to a stop token or the row's token budget,
        its remaining tokens before that step), then looked up. `appended` tells the host once it has committed
        that step."""
        B, r, D = len(seqs), row_bucket(len(seqs)), depth
        emitted, accepted, budget, stops = ahead.emitted, ahead.accepted, ahead.budget, ahead.stops
        trash, length = self.buf.shape[0] - 1, self.buf.shape[1]
        packed, L = self._send(seqs, r, ahead=emitted.shape[1])  # what the host committed and the device lacks
        slots, own, n = packed[:r], packed[:B], packed[r:r + B]  # n: each text up to the unread step
        cols = torch.arange(emitted.shape[1], device=n.device)
        count = torch.minimum(accepted + 1, budget)
        ends = torch.isin(emitted, stops) & (cols[None, :] < count[:, None])  # Sequence.append stops at the first
        count = torch.where(ends.any(1), ends.int().argmax(1) + 1, count)
        keep = cols[None, :] < count[:, None]
        self.buf[torch.where(keep, own[:, None], trash), (n[:, None] + cols).clamp(max=length - 1)] = \
            emitted.to(self.buf.dtype)
        lens = torch.cat([(n + count).clamp(max=length), n.new_ones(r - B)])
        drafts, matched = self._lookup(torch.stack([slots, lens]), L, D)
        self.last_matched = matched[:B]
        return DraftTensors(drafts[:B, None, :], None, [D] * B)

    def appended(self, seqs: list[Sequence]) -> None:
        """The host committed the step whose tokens `propose_ahead` wrote: these rows' texts are on the device as far
        as the host has them."""
        for s in seqs:
            self._state[id(s)][2] = s.cache_len + 1

    # ---- internals ------------------------------------------------------------------------------
    def _sync(self, seqs: list[Sequence], r: int) -> tuple[list[int], list[int], list[int]]:
        """Each row's slot and length, padded to r rows (the trash slot, length 1), and the slots, positions and
        tokens (three runs) of every token not yet in the buffer."""
        slots, lens, ws, wp, wt = [], [], [], [], []
        state = self._state
        fresh = [[s] for s in seqs if (st := state.get(id(s))) is None or st[0] is not s]
        if fresh:  # not begun (or a recycled id()): each a group of one
            self._register(fresh)
        for s in seqs:
            st = state[id(s)]
            n = s.cache_len + 1
            if st[2] < n:
                new = s.ids(st[2], n)
                ws += [st[1]] * len(new)
                wp += range(st[2], n)
                wt += new
                st[2] = n
            slots.append(st[1])
            lens.append(n)
        pad = r - len(seqs)
        trash = self.buf.shape[0] - 1
        return slots + [trash] * pad, lens + [1] * pad, ws + wp + wt

    def _send(self, seqs: list[Sequence], r: int, ahead: int = 0) -> tuple[torch.Tensor, int]:
        """`_sync`'s slots, lengths and writes in one copy (packed [2 * r + 3 * W]), the writes made in the buffer;
        and the context bucket the lookup reads: the longest text of the call, a sibling's too, as the host bounds it
        (`ahead`: tokens an unread step may still add to a text)."""
        slots, lens, writes = self._sync(seqs, r)
        length = self.buf.shape[1]
        self._longest = min(max(self._longest, max(lens) + ahead), length)
        packed = self.cache.ints(slots + lens + writes)
        if writes:
            at = packed[2 * r:].view(3, -1)
            self.buf[at[0], at[1]] = at[2].to(self.buf.dtype)
        return packed, bucket_for(self._longest, pow2_buckets(MIN_CONTEXT, length)) or length

    def _lookup(self, rows: torch.Tensor, L: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' lengths written, then `lookup` over the groups of their slots (rows [2, r]: slots, lengths):
        eagerly, or replayed from a graph."""
        graphs = self.graph_set()
        if graphs is None:
            return self._run(rows, L, D)
        r = rows.shape[1]
        key = (r, L, self.members.shape[1], D)
        frame = self._frames.get(key)
        if frame is None:  # static buffers outside the graphs' pool: no later capture reuses their memory
            frame = self._frames[key] = (torch.empty_like(rows), rows.new_empty(r, D), rows.new_empty(r))
        static, drafts, matched = frame
        static.copy_(rows)

        def run():  # reads the frame's input and the buffers; writes the rows' lengths and the frame's outputs
            got = self._run(static, L, D)
            drafts.copy_(got[0])
            matched.copy_(got[1])

        graphs.replay(key, run)
        return drafts, matched

    def _run(self, rows: torch.Tensor, L: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = rows[0]
        self.lens[slots] = rows[1]
        group = self.members[slots]  # [r, G] slots of each row's group, -1 past it
        there = group >= 0
        group = torch.where(there, group, slots[:, None])
        lens = torch.where(there, self.lens[group], 0)
        own = (group == slots[:, None]).int().argmax(1)
        return lookup(self.buf[group, :L], lens, own, self.max_ngram, D)

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

    def _register(self, groups: list[list[Sequence]]) -> None:
        """Slots for each group's prompt's history (as many of its newest texts as the table has room for) and for its
        samples (lengths 0), and each sample's group table (the history's slots, oldest first, then the samples'), on
        the device in one copy, the history's texts in one more. A group's slots stay until all its samples are done
        (`_release`)."""
        slots, tables, earlier, G = [], [], [], self.members.shape[1]
        for g in groups:
            record = [[], len(g)]  # the group's slots, its samples not yet done
            for text in self.history.texts(g[0].prompt_ids, G - len(g)):
                record[0].append(self._take_slot())
                earlier.append((record[0][-1], text))
            for s in g:
                slot = self._take_slot()
                record[0].append(slot)
                self._state[id(s)] = [s, slot, 0, record]
            slots += record[0]
            tables += (record[0] + [-1] * (G - len(record[0]))) * len(record[0])
        if not slots:
            return
        texts = self._history_texts(earlier)
        packed = self.cache.ints(slots + tables + texts)
        at = packed[:len(slots)]
        self.lens[at] = 0
        self.members[at] = packed[len(slots):len(slots) * (1 + G)].view(len(slots), G)
        if texts:
            n = len(texts) // 2
            past = packed[len(slots) * (1 + G):].view(2, n)
            tokens = self.cache.ints(self._history_tokens([t for _, t in earlier], n))
            self.buf[past[0], :tokens.shape[1]] = tokens
            self.lens[past[0]] = past[1]

    def _history_texts(self, earlier: list) -> list[int]:
        """The history texts' slots and lengths (two runs), padded to a power of two with the trash slot (a handful
        of copy shapes)."""
        if not earlier:
            return []
        n, trash, length = pow2_at_least(len(earlier)), self.buf.shape[0] - 1, self.buf.shape[1]
        lens = [min(len(t), length) for _, t in earlier]
        self._longest = max(self._longest, *lens)
        return [s for s, _ in earlier] + [trash] * (n - len(earlier)) + lens + [1] * (n - len(earlier))

    def _history_tokens(self, texts: list, n: int) -> torch.Tensor:
        """The texts as one int32 [n, context bucket] host tensor (rows past them zero)."""
        L = min(max(map(len, texts)), self.buf.shape[1])
        L = bucket_for(L, pow2_buckets(MIN_CONTEXT, self.buf.shape[1])) or self.buf.shape[1]
        out = torch.zeros(n, L, dtype=torch.int32)
        for row, text in zip(out, texts):
            k = min(len(text), L)
            row[:k] = torch.frombuffer(text, dtype=torch.int32)[:k]
        return out

    def _resize(self, slots: int, length: int, group: int) -> None:
        """Buffers of at least these slots (and a trash slot), positions and group size, keeping what they hold;
        graphs read the old ones' addresses, so they go with them."""
        device = self.cache.table.device
        old = (self.buf, self.lens, self.members)
        self.buf = torch.zeros(slots + 1, length, dtype=torch.int32, device=device)
        self.lens = torch.ones(slots + 1, dtype=torch.long, device=device)
        self.members = torch.full((slots + 1, group), -1, dtype=torch.long, device=device)
        self.members[:, 0] = torch.arange(slots + 1, device=device)  # a slot no group claimed lists itself
        if old[0] is not None and old[0].device == device:
            n, m, g = min(old[0].shape[0] - 1, slots), min(old[0].shape[1], length), min(old[2].shape[1], group)
            self.buf[:n, :m], self.lens[:n], self.members[:n, :g] = old[0][:n, :m], old[1][:n], old[2][:n, :g]
        if self.graphs is not None:
            self.graphs.clear()
        self._frames = {}

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._used == self.buf.shape[0] - 1:  # more samples under way than the cache has rows (preempted ones)
            self._resize(2 * self._used, self.buf.shape[1], self.members.shape[1])
        self._used += 1
        return self._used - 1

    def _release(self, key: int) -> None:
        """A sample is done: its group's slots go once every sample of the group is (siblings read them till then)."""
        st = self._state.pop(key, None)
        if st is None:
            return
        record = st[3]
        record[1] -= 1
        if record[1] <= 0:
            self._free += record[0]

    def _device(self) -> torch.device:
        return self.cache.table.device if self.cache is not None else torch.device("cpu")


def _groups_of(seqs: list[Sequence]):
    """The call's groups: its samples by prompt."""
    by_prompt: dict[int, list] = {}
    for s in seqs:
        by_prompt.setdefault(s.prompt_index, []).append(s)
    return by_prompt.values()


@DRAFTERS.register("ngram_device", learned=False, auto=False, chains_only=True)
def _build(target=None, spec=None, **overrides) -> DeviceNgramDrafter:
    """Model-free; chains only (SpecConfig.tree_width 1, `make_drafter` checks)."""
    return DeviceNgramDrafter(**overrides)
