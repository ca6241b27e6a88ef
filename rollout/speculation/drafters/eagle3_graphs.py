"""EAGLE-3's draft levels replayed from graphs: each level after the first (one drafter layer over the rows' last
outputs) is one graph launch instead of ~40 kernel launches, per row bucket, context bucket and level.

Why: a draft level is a single small decoder layer; launched eagerly from Python it costs about as much as a
target step replayed from its graph at small batches (docs/gpu.md#the-step-budget). The target's graphs come from
the same mechanism (runtime/graphs.py, `GraphSet`).

What a level's graph reads and writes (a `_Frame` of static buffers, per (row bucket r, context bucket s, local
capacity c)):
  * the rows' cached context, keys and values in float32 [r, KV, s, D], and its mask bias [r, 1, 1, s]
    (positions at or past each row's length hidden), copied in once per proposal;
  * the level's inputs: the previous output h [r, 1, H], the drafted token's embedding, RoPE cos/sin;
  * the branch's own draft keys [r, KV, c, D] in float32: level j writes its key at index j and attends indices
    0..j, as `_DraftAttention` holds them in a list, so chains and tree branches sharing a row never clobber each
    other and the paged cache is never written.
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


def row_bucket(rows: int) -> int:
    """1, 2, 4, 8, then multiples of 16: the batch buckets of the target's graphs (graphs.batch_buckets)."""
    return next((b for b in (1, 2, 4, 8) if b >= rows), -(-rows // 16) * 16)


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _Frame:
    """Static buffers of one (r, s, c) key; see the module docstring."""

    def __init__(self, r: int, s: int, c: int, kv: int, d: int, hidden: int, dtype, device):
        with torch.inference_mode(False):  # copies into them must work in and outside inference mode
            f32 = dict(dtype=torch.float32, device=device)
            self.ctx_k, self.ctx_v = torch.zeros(r, kv, s, d, **f32), torch.zeros(r, kv, s, d, **f32)
            self.bias = torch.zeros(r, 1, 1, s, **f32)
            self.local_k, self.local_v = torch.zeros(r, kv, c, d, **f32), torch.zeros(r, kv, c, d, **f32)
            self.h = torch.zeros(r, 1, hidden, dtype=dtype, device=device)
            self.embeds = torch.zeros(r, 1, hidden, dtype=dtype, device=device)
            self.cos = torch.zeros(r, 1, 1, d, dtype=dtype, device=device)
            self.sin = torch.zeros(r, 1, 1, d, dtype=dtype, device=device)
            self.out = torch.zeros(r, 1, hidden, dtype=dtype, device=device)
        self.positions = torch.arange(s, device=device)

    def load_context(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor, lens: torch.Tensor) -> None:
        """ctx_k, ctx_v [R, KV, S, D] (S <= s), lens [R]: rows 0..R-1's context and mask."""
        R, _, S, _ = ctx_k.shape
        self.ctx_k[:R, :, :S].copy_(ctx_k)
        self.ctx_v[:R, :, :S].copy_(ctx_v)
        hidden = self.positions[None, :] >= lens[:, None]
        self.bias[:R].copy_(torch.zeros(hidden.shape, device=lens.device).masked_fill(hidden, float("-inf"))[:, None, None])

    def level(self, model, j: int) -> None:
        """Draft level j + 1 from the static inputs into `out` (what a graph captures)."""
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
            self.out.copy_(model(self.h, self.embeds, self.cos, self.sin, attend))


class DraftLevelGraphs:
    """The draft levels of one drafter network as graphs (backend "cuda"), or their bookkeeping replayed by
    calling (backend "emulate": the CPU tests of keys, buckets and padding)."""

    def __init__(self, model, device, backend: str = "cuda"):
        self.model = model
        self.graphs = GraphSet(device, backend)
        self.frames: dict[tuple, _Frame] = {}
        self.capacity = 1

    @property
    def counts(self) -> dict:
        return self.graphs.counts

    def key(self, rows: int, context: int, levels: int) -> tuple[int, int, int]:
        """(row bucket, context bucket, local capacity) of a proposal: `rows` branches, a gathered context of
        `context` positions (whole blocks), `levels` draft levels after the first. The capacity is the most levels
        seen so far (a proposal capped near the token limit reuses the full depth's frame)."""
        self.capacity = max(self.capacity, pow2_at_least(max(levels, 1)))
        return row_bucket(rows), pow2_at_least(context), self.capacity

    def steps(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor, lens: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor):
        """step(h, embeds, j) for one proposal, as ChainDraws' eager steps: ctx_k, ctx_v [R, KV, S, D] the rows'
        cached context, lens [R] their lengths, cos and sin [depth - 1, R, 1, 1, D] the levels' RoPE. h and
        embeds [R, 1, H] -> the level's output [R, 1, H]."""
        R, KV, S, D = ctx_k.shape
        r, s, c = self.key(R, S, cos.shape[0])
        frame = self.frames.pop((r, s, c), None)
        if frame is None:
            if len(self.frames) >= MAX_FRAMES:  # the least recently used frame and its levels' graphs go
                old = next(iter(self.frames))
                del self.frames[old]
                for key in [k for k in self.graphs.graphs if k[:3] == old]:
                    del self.graphs.graphs[key]
            p = self.model.lm_head.weight
            frame = _Frame(r, s, c, KV, D, h_size(self.model), p.dtype, p.device)
        self.frames[(r, s, c)] = frame  # most recently used last
        frame.load_context(ctx_k, ctx_v, lens)

        def step(h, embeds, j: int):
            frame.h[:R].copy_(h)
            frame.embeds[:R].copy_(embeds)
            frame.cos[:R].copy_(cos[j])
            frame.sin[:R].copy_(sin[j])
            self.graphs.replay((r, s, c, j), lambda: frame.level(self.model, j))
            return frame.out[:R].clone()  # the next replay overwrites it

        return step


def h_size(model) -> int:
    return model.cfg.hidden_size
