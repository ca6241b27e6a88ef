"""EAGLE-3's draft levels replayed from graphs: each level after the first (one drafter layer over the rows' last
outputs, its draft-vocabulary head and the draw of the next token) is one graph launch instead of ~70 kernel
launches, per row bucket, context bucket, level and way of drawing; and so is a proposal's catch-up (the drafter over
the positions it has not seen, writing its KV layer), per row bucket, positions bucket and context bucket.

Why: a draft level is a single small decoder layer; launched eagerly from Python it costs about as much as a
target step replayed from its graph at small batches (docs/gpu.md#the-step-budget), and a level whose layer alone
was a graph still launched its head and its draw, ~25 kernels, from Python. The target's graphs come from the same
mechanism (runtime/graphs.py, `GraphSet`).

What a level's graph reads and writes (a `_Frame` of static buffers, per (row bucket r, context bucket s, local
capacity c)):
  * the rows' cached context, keys and values in float32 [r, KV, s, D], and its mask bias [r, 1, 1, s]
    (positions at or past each row's length hidden), copied in once per proposal;
  * the level's inputs: the previous output h [r, 1, H] and the drafted token's embedding, which each level
    writes for the next; every level's RoPE cos/sin [c, r, 1, 1, D] and uniforms [c, r, 1], copied in once per
    proposal, with the draft vocabulary's target ids and the branches' histories (a repetition penalty's);
  * the branch's own draft keys [r, KV, c, D] in float32: level j writes its key at index j and attends indices
    0..j, as `_DraftAttention` holds them in a list, so chains and tree branches sharing a row never clobber each
    other and the paged cache is never written;
  * what each level drew: target ids [r, c], their distributions q [r, c, Vd] (sampling) and the stop rule's
    verdicts [r, c].
How a level draws (greedy or sampling, the processing, the stop rule) is part of its graph's key: the pick is
ChainDraws._pick, the eager levels' own.

A catch-up's graph (`catch_up`) reads one buffer of inputs, r * (4 * c + 1) long: per row and position its token,
slot, RoPE position and last visible position (`Eagle3Drafter._grid`), then each row's index of its last real position;
it runs `Eagle3Drafter._catch_up_forward`, the eager catch-up's own code, over s cached positions, and keeps each
row's output there. Padding positions and rows write the trash block and read what their mask hides. Unlike the
levels' frames it reads and writes the KV pool, the staged features and the block table in place, so its graphs
go when any of those is reallocated (the `binding` the drafter passes).
The math is `_DraftAttention`'s, on the same inputs; rows past the live ones (padding to the bucket) run stale,
finite values and are dropped. Nothing a graph holds points into the KV pool, so a pool that grows or is
reallocated leaves the graphs valid; weights change in place (load_state_dict), which the graphs see.
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.graphs import GraphSet

GRAPH_MODES = ("auto", "off", "emulate")  # auto: CUDA graphs on a CUDA device, eager elsewhere
# frames (and their graphs) kept at once: a frame's context buffers are rows x context in float32 (~1 GB at 32
# rows of 8k positions of a 7B shape), so the least recently used goes when a new key needs room
MAX_FRAMES = 8
MAX_CATCH_UPS = 16  # catch-up graphs kept at once (least recently used first out): a few MB of buffers each


def row_bucket(rows: int) -> int:
    """1, 2, 4, 8, then multiples of 16: the batch buckets of the target's graphs (graphs.batch_buckets)."""
    return next((b for b in (1, 2, 4, 8) if b >= rows), -(-rows // 16) * 16)


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _Frame:
    """Static buffers of one (r, s, c) key; see the module docstring."""

    def __init__(self, r: int, s: int, c: int, kv: int, d: int, cfg, dtype, device):
        with torch.inference_mode(False):  # copies into them must work in and outside inference mode
            f32 = dict(dtype=torch.float32, device=device)
            self.ctx_k, self.ctx_v = torch.zeros(r, kv, s, d, **f32), torch.zeros(r, kv, s, d, **f32)
            self.bias = torch.zeros(r, 1, 1, s, **f32)
            self.local_k, self.local_v = torch.zeros(r, kv, c, d, **f32), torch.zeros(r, kv, c, d, **f32)
            self.h = torch.zeros(r, 1, cfg.hidden_size, dtype=dtype, device=device)
            self.embeds = torch.zeros(r, 1, cfg.hidden_size, dtype=dtype, device=device)
            self.cos = torch.zeros(c, r, 1, 1, d, dtype=dtype, device=device)
            self.sin = torch.zeros(c, r, 1, 1, d, dtype=dtype, device=device)
            self.out = torch.zeros(r, 1, cfg.hidden_size, dtype=dtype, device=device)
            self.u = torch.full((c, r, 1), 0.5, **f32)
            self.vocab = torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=device)
            self.ids = torch.zeros(r, c, dtype=torch.long, device=device)
            self.ok = torch.ones(r, c, dtype=torch.bool, device=device)
        self.q = self.seen = None  # [r, c, Vd] and [r, V]: made when a proposal samples or penalises
        self.shape = (r, c, cfg.draft_vocab_size, cfg.vocab_size)
        self.positions = torch.arange(s, device=device)

    def load(self, h, embeds, cos, sin, us, vocab, seen) -> None:
        """A proposal's inputs for rows 0..R-1 (see DraftLevelGraphs.draws)."""
        R, S = h.shape[0], cos.shape[0]
        r, c, vd, v = self.shape
        self.h[:R].copy_(h[:, None])
        self.embeds[:R].copy_(embeds)
        self.cos[:S, :R].copy_(cos)
        self.sin[:S, :R].copy_(sin)
        self.vocab.copy_(vocab)
        with torch.inference_mode(False):
            if us is not None:
                self.u[:S, :R].copy_(us)
                if self.q is None:
                    self.q = torch.zeros(r, c, vd, dtype=torch.float32, device=h.device)
            if seen is not None:
                if self.seen is None:
                    self.seen = torch.zeros(r, v, dtype=torch.bool, device=h.device)
                self.seen[:R].copy_(seen)

    def load_context(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor, lens: torch.Tensor) -> None:
        """ctx_k, ctx_v [R, KV, S, D] (S <= s), lens [R]: rows 0..R-1's context and mask."""
        R, _, S, _ = ctx_k.shape
        self.ctx_k[:R, :, :S].copy_(ctx_k)
        self.ctx_v[:R, :, :S].copy_(ctx_v)
        hidden = self.positions[None, :] >= lens[:, None]
        self.bias[:R].copy_(torch.zeros(hidden.shape, device=lens.device).masked_fill(hidden, float("-inf"))[:, None, None])

    def draw_level(self, model, j: int, pick, embed, sampling: bool, penalised: bool) -> None:
        """Draft level j + 1 and its draw, from the static inputs into the static outputs (what a graph captures):
        the layer's output becomes the next level's h, the drawn token's embedding its embeds."""
        self.level(model, j)
        tok, q, ok = pick(self.out[:, 0], self.vocab, self.seen if penalised else None, self.u[j])
        with torch.inference_mode():
            self.ids[:, j].copy_(tok)
            if sampling:
                self.q[:, j].copy_(q)
            if ok is not None:
                self.ok[:, j].copy_(ok)
            self.h.copy_(self.out)
            self.embeds.copy_(embed(tok[:, None]))
            if penalised:
                self.seen.scatter_(1, tok[:, None], True)

    def level(self, model, j: int) -> None:
        """Draft level j + 1's layer from the static inputs into `out`."""
        def attend(q, k, v):
            self.local_k[:, :, j:j + 1].copy_(k)
            self.local_v[:, :, j:j + 1].copy_(v)
            R, H, T, D = q.shape
            KV, S = self.ctx_k.shape[1], self.ctx_k.shape[2]
            qf = q.float().reshape(R, KV, H // KV * T, D) * D ** -0.5
            lk, lv = self.local_k[:, :, :j + 1], self.local_v[:, :, :j + 1]
            scores = torch.cat([qf @ self.ctx_k.transpose(-1, -2) + self.bias, qf @ lk.transpose(-1, -2)], -1)
            p = torch.softmax(scores, -1)
            out = p[..., :S] @ self.ctx_v + p[..., S:] @ lv
            return out.reshape(R, H, T, D).to(q.dtype)

        with torch.inference_mode():
            self.out.copy_(model(self.h, self.embeds, self.cos[j], self.sin[j], attend))


class _CatchUpFrame:
    """Static buffers of one catch-up key (r, c, s): its inputs (one host copy a proposal) and each row's output."""

    def __init__(self, r: int, c: int, hidden: int, dtype, device):
        with torch.inference_mode(False):
            self.inputs = torch.zeros(r * 4 * c + r, dtype=torch.long, device=device)
            self.h = torch.zeros(r, hidden, dtype=dtype, device=device)
        # pinned on CUDA, so the copy does not block the host; written again only by the next proposal, after
        # this one's drafts came to the host (which waited for everything this one queued)
        cuda = self.inputs.is_cuda
        self.staging = torch.zeros(self.inputs.shape, dtype=torch.long, pin_memory=cuda) if cuda else None
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

    def key(self, rows: int, context: int, levels: int) -> tuple[int, int, int]:
        """(row bucket, context bucket, local capacity) of a proposal: `rows` branches, a gathered context of
        `context` positions (whole blocks), `levels` draft levels after the first. The capacity is the most levels
        seen so far (a proposal capped near the token limit reuses the full depth's frame)."""
        self.capacity = max(self.capacity, pow2_at_least(max(levels, 1)))
        return row_bucket(rows), pow2_at_least(context), self.capacity

    def draws(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor, lens: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, h: torch.Tensor, embeds: torch.Tensor, seen, us, vocab: torch.Tensor, pick, embed,
              sig: tuple):
        """One proposal's levels after the first, each replayed from its graph: ctx_k, ctx_v [R, KV, S, D] the
        rows' cached context, lens [R] their lengths, cos and sin [depth - 1, R, 1, 1, D] the levels' RoPE, h [R, H]
        the first level's output and embeds [R, 1, H] its drawn tokens' embedding, seen [R, V] bool their history
        or None, us [depth - 1, R, 1] the levels' uniforms or None (greedy), vocab [Vd] the draft vocabulary's
        target ids; pick(h, vocab, seen, u) -> (tokens [r], q [r, Vd] or None, sure [r] or None) draws a level
        (ChainDraws), embed(tokens [r, 1]) -> [r, 1, H]; sig: how pick draws (part of each graph's key).
        -> (target ids [R, depth - 1], q [R, depth - 1, Vd] or None, sure [R, depth - 1]: all True without a stop
        rule)."""
        R, KV, S, D = ctx_k.shape
        levels = cos.shape[0]
        r, s, c = self.key(R, S, levels)
        frame = self._frame(r, s, c, KV, D)
        frame.load_context(ctx_k, ctx_v, lens)
        frame.load(h, embeds, cos, sin, us, vocab, seen)
        sampling, penalised = us is not None, seen is not None
        for j in range(levels):
            self.graphs.replay((r, s, c, j, sig), lambda j=j: frame.draw_level(self.model, j, pick, embed, sampling,
                                                                               penalised))
        return (frame.ids[:R, :levels].clone(), frame.q[:R, :levels].clone() if sampling else None,
                frame.ok[:R, :levels].clone())

    @staticmethod
    def catch_up_key(rows: int, positions: int, context: int, table_rows: int, length: int) -> tuple[int, int, int]:
        """(row bucket r, positions bucket c, context bucket s) of a catch-up of `positions` a row over `context`
        cached positions (whole blocks): the row buckets of the levels up to the table's rows, powers of two of
        positions and of context up to the cache's length."""
        return min(row_bucket(rows), table_rows), pow2_at_least(positions), min(pow2_at_least(context), length)

    def catch_up(self, inputs: list[int], shape: tuple[int, int], s: int, binding: tuple, forward) -> torch.Tensor:
        """A catch-up replayed from its graph: inputs, on the host, its grid [r, 4, c] flattened
        (`Eagle3Drafter._grid`, padded to the key's (r, c) = shape) and then each row's index of its last real
        position [r]; s the context bucket, binding what the graphs hold the addresses of; forward(grid, s) ->
        [r, c, H] (`Eagle3Drafter._catch_up_forward`). -> the rows' last outputs [r, H] (a copy)."""
        if binding != self.binding:  # a pool grew, or a new cache or RoPE table: the old addresses are gone
            for key in self.catch_ups:
                self.graphs.graphs.pop(key, None)
            self.catch_ups.clear()
            self.binding = binding
        r, c = shape
        key = ("catch_up", r, c, s)
        frame = self.catch_ups.pop(key, None)
        if frame is None:
            if len(self.catch_ups) >= MAX_CATCH_UPS:
                old = next(iter(self.catch_ups))
                del self.catch_ups[old]
                self.graphs.graphs.pop(old, None)
            p = self.model.lm_head.weight
            frame = _CatchUpFrame(r, c, self.model.cfg.hidden_size, p.dtype, p.device)
        self.catch_ups[key] = frame
        host = torch.tensor(inputs)
        if frame.staging is not None:
            host = frame.staging.copy_(host)
        frame.inputs.copy_(host, non_blocking=True)

        def run():
            with torch.inference_mode():
                frame.h.copy_(forward(frame.grid, s)[frame.rows, frame.last])

        self.graphs.replay(key, run)
        return frame.h.clone()

    def _frame(self, r: int, s: int, c: int, kv: int, d: int) -> _Frame:
        """The frame of key (r, s, c), made when missing; it becomes the most recently used."""
        frame = self.frames.pop((r, s, c), None)
        if frame is None:
            if len(self.frames) >= MAX_FRAMES:  # the least recently used frame and its levels' graphs go
                old = next(iter(self.frames))
                del self.frames[old]
                for key in [k for k in self.graphs.graphs if k[:3] == old]:
                    del self.graphs.graphs[key]
            p = self.model.lm_head.weight
            frame = _Frame(r, s, c, kv, d, self.model.cfg, p.dtype, p.device)
        self.frames[(r, s, c)] = frame  # most recently used last
        return frame
