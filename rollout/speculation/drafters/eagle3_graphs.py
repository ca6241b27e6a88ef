"""EAGLE-3's proposals replayed from graphs: the catch-up (the drafter over the positions it has not seen, writing
its KV layer) is one graph launch per row bucket, positions bucket and context bucket; each draft level (the first:
the draw from the catch-up's output; each later one: one drafter layer over the previous output, its
draft-vocabulary head and the draw) is one graph launch per row bucket, context bucket, level and way of drawing.
A proposal of depth 4 then launches ~20 kernels and graphs from Python where it launched ~270 (bench_out/kernels.json).

Why: a draft level is a single small decoder layer; launched eagerly from Python it costs about as much as a
target step replayed from its graph at small batches (docs/gpu.md#the-step-budget): the device waits for the host's
launches. The target's graphs come from the same mechanism (runtime/graphs.py, `GraphSet`).

What a level's graph reads and writes (a `_Frame` of static buffers, per (row bucket r, context bucket s, capacity
c)):
  * in place, what `Held` names: the drafter's KV layer in the paged pool, read through the block table's rows by
    the proposal's first graph into the frame's context buffers in float32 [r, KV, s, D] (s positions: whole
    blocks, a power of two up to the cache's length) with their mask bias [r, 1, 1, s] (positions at or past each
    row's length hidden), which every level reads; and the target's RoPE tables at each branch's position;
  * the proposal's inputs: each branch's table row and length (one small copy through the decode loop's funnel,
    runtime/transfers.py), the catch-up's output h [r, 1, H] (each row's in each of its branches: a tree's root
    children, `width` a row, are drawn together by level 0 from one of them, a row's branches being neighbours),
    every level's uniforms [c, r, 1], the draft vocabulary's target ids and the branches' histories (a repetition
    penalty's); each level writes its output and its token's embedding for the next;
  * the branch's own draft keys [r, KV, c, D] in float32: level d writes its key at index d - 1 and attends indices
    0..d - 1, as `_DraftAttention` holds them in a list, so chains and tree branches sharing a row never clobber
    each other and the paged cache is never written;
  * what each level drew: target ids [r, c], their distributions q [r, c, Vd] (sampling) and the stop rule's
    verdicts [r, c].
How a level draws (greedy or sampling, the processing, the stop rule, and level 0's width) is part of its graph's
key: the pick is ChainDraws._pick, the eager levels' own, and so is their attention (`attend_apart`,
`_DraftAttention`'s): the context scored in float32 on its own, then the branch's draft keys.

A catch-up's graph (`catch_up`) reads one buffer of inputs, r * (4 * c + 1) long (one copy through the funnel): per
row and position its token, slot, RoPE position and last visible position (`Eagle3Drafter._grid`), then each row's
index of its last real position; it runs `Eagle3Drafter._catch_up_forward`, the eager catch-up's own code, over s
cached positions, and keeps each row's output there.

Rows past the live ones (padding to the bucket) read table row 0 and write the trash block (a catch-up) or their
own buffers (a level); their outputs are dropped. The graphs hold the addresses of what `Held` names; when any of
those is reallocated (a pool that grew, a new cache, new RoPE tables) every frame and graph goes (`_bind`). Weights
change in place (load_state_dict), which the graphs see.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlspec.rollout.runtime.graphs import GraphSet
from rlspec.rollout.runtime.kv_cache import gather_blocks
from rlspec.rollout.speculation.drafters.eagle3_draws import attend_apart, context_bias

GRAPH_MODES = ("auto", "off", "emulate")  # auto: CUDA graphs on a CUDA device, eager elsewhere
# frames (and their graphs) kept at once: a frame's context buffers are rows x context in float32 (~1 GB at 32
# rows of 8k positions of a 7B shape), so the least recently used goes when a new key needs room
MAX_FRAMES = 8
MAX_CATCH_UPS = 16  # catch-up graphs kept at once (least recently used first out): a few MB of buffers each
# the most positions a row a catch-up graph runs: a step's commits (a draft's depth + 1). A longer catch-up (the
# drafter sat out steps, or a preempted row came back) is rare and runs eagerly: a graph of it would hold its
# activations (at a 7B shape, 32 rows of 512 positions: ~0.35 GB of features alone) in the pool for good
MAX_CATCH_UP_POSITIONS = 16


def row_bucket(rows: int) -> int:
    """1, 2, 4, 8, then multiples of 16: the batch buckets of the target's graphs (graphs.batch_buckets)."""
    return next((b for b in (1, 2, 4, 8) if b >= rows), -(-rows // 16) * 16)


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Held:
    """What the drafter's graphs read and write in place: its KV layer's pools [blocks, bs, KV, D], the block table,
    the staged target features, and the target's RoPE tables in its dtype; with the cache's block size and length
    (positions a row addresses)."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    features: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    block_size: int
    length: int

    def binding(self) -> tuple:
        """(address, shape) of each: what tells that a graph captured over them may still run."""
        return tuple((t.data_ptr(), tuple(t.shape)) for t in (self.k, self.v, self.table, self.features, self.cos,
                                                              self.sin))


class _Frame:
    """Static buffers of one (r, s, c) key; see the module docstring."""

    def __init__(self, r: int, s: int, c: int, kv: int, d: int, cfg, dtype, device):
        with torch.inference_mode(False):  # copies into them must work in and outside inference mode
            f32 = dict(dtype=torch.float32, device=device)
            self.index = torch.zeros(2 * r, dtype=torch.long, device=device)  # table rows, then lengths
            self.ctx_k, self.ctx_v = torch.zeros(r, kv, s, d, **f32), torch.zeros(r, kv, s, d, **f32)
            self.bias = torch.zeros(r, 1, 1, s, **f32)
            self.local_k, self.local_v = torch.zeros(r, kv, c, d, **f32), torch.zeros(r, kv, c, d, **f32)
            self.h = torch.zeros(r, 1, cfg.hidden_size, dtype=dtype, device=device)
            self.embeds = torch.zeros(r, 1, cfg.hidden_size, dtype=dtype, device=device)
            self.out = torch.zeros(r, 1, cfg.hidden_size, dtype=dtype, device=device)
            self.u = torch.full((c, r, 1), 0.5, **f32)
            self.vocab = torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=device)
            self.ids = torch.zeros(r, c, dtype=torch.long, device=device)
            self.ok = torch.ones(r, c, dtype=torch.bool, device=device)
        self.rows, self.lens = self.index[:r], self.index[r:]
        self.vocab_of = None  # the draft vocabulary copied in last (it changes with the drafter's weights only)
        self.q = self.seen = None  # [r, c, Vd] and [r, V]: made when a proposal samples or penalises
        self.shape = (r, s, c, cfg.draft_vocab_size, cfg.vocab_size)
        self.positions = torch.arange(s, device=device)

    def load(self, ints, rows: list[int], lens: list[int] | torch.Tensor, h, us, vocab, seen) -> None:
        """A proposal's inputs for branches 0..R-1 (see DraftLevelGraphs.draws; lens on the host, or on the device);
        padding branches read table row 0 at length 1."""
        R = h.shape[0]
        r, s, c, vd, v = self.shape
        if isinstance(lens, torch.Tensor):
            self.index.copy_(ints(rows + [0] * (r - R) + [1] * r))
            self.lens[:R].copy_(lens)
        else:
            self.index.copy_(ints(rows + [0] * (r - R) + lens + [1] * (r - R)))
        self.h[:R].copy_(h[:, None])
        if self.vocab_of is not vocab:
            self.vocab.copy_(vocab)
            self.vocab_of = vocab
        with torch.inference_mode(False):
            if us is not None:
                self.u[:us.shape[0], :R].copy_(us)
                if self.q is None:
                    self.q = torch.zeros(r, c, vd, dtype=torch.float32, device=h.device)
            if seen is not None:
                if self.seen is None:
                    self.seen = torch.zeros(r, v, dtype=torch.bool, device=h.device)
                self.seen[:R].copy_(seen)

    def kept(self):
        """What a level's draw changes of its own inputs (h, embeds and the history), saved, and the function that
        puts it back (GraphSet.replay's keep: a capture's warm-ups run the draw and would advance them)."""
        saved = [(t, t.clone()) for t in (self.h, self.embeds, self.seen) if t is not None]

        def restore() -> None:
            with torch.inference_mode():
                for t, copy in saved:
                    t.copy_(copy)
        return restore

    def draw(self, model, held: Held, d: int, width: int, pick, embed, sampling: bool, penalised: bool) -> None:
        """Draft level d's draw, from the static inputs into the static outputs (what a graph captures). Level 0
        reads the rows' context first and draws from h as it is (the catch-up's output, each row's in its `width`
        branches): `width` tokens a row, one a branch, from one row of each branch group's (a tree's root children,
        drawn together: without replacement, they depend on each other). A later level runs the layer first, whose
        output becomes the next level's h, and draws a token a branch. The drawn token's embedding becomes
        `embeds`."""
        seen = self.seen if penalised else None
        if d == 0:
            self.read_context(held)
            tok, q, ok = pick(self.h[::width, 0], self.vocab, None if seen is None else seen[::width],
                              self.u[0].view(-1, width), width)
        else:
            self.level(model, held, d - 1)
            tok, q, ok = pick(self.out[:, 0], self.vocab, seen, self.u[d], 1)
        with torch.inference_mode():
            self.ids[:, d].copy_(tok)
            if sampling:
                self.q[:, d].copy_(q)
            if ok is not None:
                self.ok[:, d].copy_(ok)
            if d > 0:
                self.h.copy_(self.out)
            self.embeds.copy_(embed(tok[:, None]))
            if penalised:
                self.seen.scatter_(1, tok[:, None], True)

    def read_context(self, held: Held) -> None:
        """The rows' cached context, read through their table rows, into the context buffers in float32, and its
        mask: converted once a proposal, as `_DraftAttention` does, not once a level."""
        s = self.shape[1]
        blocks = held.table[self.rows, : s // held.block_size]
        with torch.inference_mode():
            self.ctx_k.copy_(gather_blocks(held.k, blocks))
            self.ctx_v.copy_(gather_blocks(held.v, blocks))
            self.bias.copy_(context_bias(self.positions, self.lens))

    def level(self, model, held: Held, j: int) -> None:
        """Draft level j + 1's layer from the static inputs into `out`: it stands at position length + j (the
        eager levels' `_step_rope`), attends over its row's s cached positions (the context buffers) and its
        branch's earlier draft keys, and keeps its key at index j."""
        pos = (self.lens + j).clamp(max=held.cos.shape[0] - 1)
        cos, sin = held.cos[pos][:, None, None], held.sin[pos][:, None, None]  # [r, 1, 1, D]

        def attend(q, k, v):
            self.local_k[:, :, j:j + 1].copy_(k)
            self.local_v[:, :, j:j + 1].copy_(v)
            return attend_apart(q, self.ctx_k, self.ctx_v, self.bias, self.local_k[:, :, :j + 1],
                                self.local_v[:, :, :j + 1])

        with torch.inference_mode():
            self.out.copy_(model(self.h, self.embeds, cos, sin, attend))


class _CatchUpFrame:
    """Static buffers of one catch-up key (r, c, s): its inputs and each row's output."""

    def __init__(self, r: int, c: int, hidden: int, dtype, device):
        with torch.inference_mode(False):
            self.inputs = torch.zeros(r * 4 * c + r, dtype=torch.long, device=device)
            self.h = torch.zeros(r, hidden, dtype=dtype, device=device)
        self.grid, self.last = self.inputs[:r * 4 * c].view(r, 4, c), self.inputs[r * 4 * c:]
        self.rows = torch.arange(r, device=device)


class DraftLevelGraphs:
    """The draft levels of one drafter network as graphs (backend "cuda"), or their bookkeeping replayed by
    calling (backend "emulate": the CPU tests of keys, buckets and padding)."""

    def __init__(self, model, device, backend: str = "cuda"):
        self.model = model
        self.graphs = GraphSet(device, backend)
        self.frames: dict[tuple, _Frame] = {}
        self.capacity = 1
        self.catch_ups: dict[tuple, _CatchUpFrame] = {}  # ("catch_up", r, c, s) -> frame, most recently used last
        self.binding = None

    @property
    def counts(self) -> dict:
        return self.graphs.counts

    def key(self, rows: int, context: int, depth: int, length: int, width: int = 1) -> tuple[int, int, int]:
        """(row bucket, context bucket, capacity) of a proposal: `rows` branches, `width` a sequence, over a context
        of `context` positions (whole blocks; the cache holds `length`), `depth` draft levels. The row bucket is the
        sequences' times the width (whole branch groups: the root's draw takes one row a group). The capacity is the
        most levels seen so far (a proposal capped near the token limit reuses the full depth's frame)."""
        self.capacity = max(self.capacity, pow2_at_least(depth))
        return row_bucket(-(-rows // width)) * width, min(pow2_at_least(context), length), self.capacity

    def draws(self, held: Held, ints, rows: list[int], lens: list[int] | torch.Tensor, depth: int, width: int,
              h: torch.Tensor, seen, us, vocab: torch.Tensor, pick, embed, sig: tuple, longest: int | None = None):
        """One proposal's `depth` draft levels, each replayed from its graph, for branches of `width` a row (a tree's
        root children; a chain: 1). held: what they read in place; ints(host integers) -> a device tensor (the
        decode loop's funnel, kv_cache.PagedKVCache.ints); rows [R] each branch's table row and lens [R] its length,
        h [R, H] its row's catch-up output, seen [R, V] bool its row's history or None, us [depth, R, 1] the levels'
        uniforms in branch order or None (greedy), vocab [Vd] the draft vocabulary's target ids; pick(h, vocab, seen,
        u, k) -> (tokens [rows * k], q [rows * k, Vd] or None, sure [rows * k] or None) draws k tokens a row of h
        (ChainDraws), embed(tokens [r, 1]) -> [r, 1, H]; sig: how pick draws (part of each graph's key); lens may be
        on the device, with `longest` a host bound of the largest. -> (target ids [R, depth], q [R, depth, Vd] or
        None, sure [R, depth]: all True without a stop rule)."""
        self._bind(held)
        longest = max(lens) if longest is None else longest
        r, s, c = self.key(len(rows), -(-longest // held.block_size) * held.block_size, depth, held.length, width)
        frame = self._frame(r, s, c, held.k.shape[2], held.k.shape[3])
        frame.load(ints, rows, lens, h, us, vocab, seen)
        sampling, penalised = us is not None, seen is not None
        for d in range(depth):  # level 0's graph draws `width` tokens a row: part of its key
            w = width if d == 0 else 1
            self.graphs.replay((r, s, c, d, sig, w), lambda d=d, w=w: frame.draw(self.model, held, d, w, pick, embed,
                                                                                sampling, penalised), frame.kept)
        R = len(rows)
        return (frame.ids[:R, :depth].clone(), frame.q[:R, :depth].clone() if sampling else None,
                frame.ok[:R, :depth].clone())

    @staticmethod
    def catch_up_key(rows: int, positions: int, context: int, held: Held) -> tuple[int, int, int]:
        """(row bucket r, positions bucket c, context bucket s) of a catch-up of `positions` a row over `context`
        cached positions (whole blocks): the row buckets of the levels up to the table's rows, powers of two of
        positions and of context up to the cache's length."""
        return (min(row_bucket(rows), held.table.shape[0]), pow2_at_least(positions),
                min(pow2_at_least(context), held.length))

    def catch_up(self, held: Held, inputs: torch.Tensor, shape: tuple[int, int], s: int, forward) -> torch.Tensor:
        """A catch-up replayed from its graph: held what it reads and writes in place; inputs, on the device, its
        grid [r, 4, c] flattened (`Eagle3Drafter._grid`, padded to the key's (r, c) = shape) and then each row's index
        of its last real position [r]; s the context bucket; forward(grid, s) -> [r, c, H]
        (`Eagle3Drafter._catch_up_forward`). -> the rows' last outputs [r, H]: the frame's buffer, which the next
        catch-up of this key overwrites (the proposal's levels read it first: they are queued before it)."""
        self._bind(held)
        r, c = shape
        key = ("catch_up", r, c, s)
        p = self.model.lm_head.weight
        frame = self._recent(self.catch_ups, key, MAX_CATCH_UPS,
                             lambda: _CatchUpFrame(r, c, self.model.cfg.hidden_size, p.dtype, p.device))
        frame.inputs.copy_(inputs)

        def run():
            with torch.inference_mode():
                frame.h.copy_(forward(frame.grid, s)[frame.rows, frame.last])

        self.graphs.replay(key, run)
        return frame.h

    def _bind(self, held: Held) -> None:
        """Every frame and graph goes when what they hold the addresses of was reallocated (a pool that grew, a new
        cache or new RoPE tables)."""
        binding = held.binding()
        if binding != self.binding:
            self.graphs.clear()
            self.frames.clear()
            self.catch_ups.clear()
            self.binding = binding

    def _frame(self, r: int, s: int, c: int, kv: int, d: int) -> _Frame:
        """The frame of key (r, s, c), made when missing; it becomes the most recently used."""
        p = self.model.lm_head.weight
        return self._recent(self.frames, (r, s, c), MAX_FRAMES,
                            lambda: _Frame(r, s, c, kv, d, self.model.cfg, p.dtype, p.device))

    def _recent(self, frames: dict, key: tuple, limit: int, make):
        """frames[key], made by make() when missing, now the most recently used (last). When `limit` are kept, the
        least recently used goes with its graphs: those whose keys begin with its key (a level frame's (r, s, c)
        begins each of its levels' keys; a catch-up's key is its graph's)."""
        frame = frames.pop(key, None)
        if frame is None:
            if len(frames) >= limit:
                old = next(iter(frames))
                del frames[old]
                for k in [k for k in self.graphs.graphs if k[:len(old)] == old]:
                    del self.graphs.graphs[k]
            frame = make()
        frames[key] = frame
        return frame
