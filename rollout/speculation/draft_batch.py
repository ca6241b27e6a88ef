"""Turn per-sequence drafts into the padded tensors one verify forward needs.

Node 0 of every row is the sequence's pending token; node j+1 is draft node j. Rows are padded to
the largest draft; padding nodes have no parent link, so they are never reachable in verification
and their KV (written past the sequence's length) is never shown again.

Drafts come as Drafts (host tokens) or as DraftTensors (a learned drafter's, on the device): the host lays out
both alike from what it knows, each row's tree, and the tokens of DraftTensors are gathered where they are.
"""
from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass

import torch

from rlspec.rollout.speculation.drafters.base import Draft, DraftTensors


@dataclass
class DraftBatch:
    tokens: torch.Tensor  # [B, N+1] long: pending token, then draft nodes
    num_drafts: torch.Tensor  # [B] long
    is_chain: bool
    depths: torch.Tensor | None = None  # [B, N+1] long RoPE offsets (trees only)
    tree_mask: torch.Tensor | None = None  # [B, N+1, N+1] bool, node may see node (trees only)
    children: torch.Tensor | None = None  # [B, N+1, W] long child node indices, -1 none (trees only)
    # sampled drafts: the distribution each draft node was drawn from (for a tree node: given the
    # siblings drawn before it); chains [B, N, V], trees [B, N+1, V] (node 0 unused). None for
    # deterministic drafts. Padding rows and nodes are never reached.
    q: torch.Tensor | None = None
    start: torch.Tensor | None = None  # [B] long: cache entries each row holds (when built with `start`)
    kv_len: int = 0  # max(start) + N + 1: the cache positions the step's attention spans
    depth: int | None = None  # trees: the deepest draft node of any row (verification walks no further)

    @property
    def N(self) -> int:
        return self.tokens.shape[1] - 1

    def to(self, device) -> "DraftBatch":
        """The same batch with every tensor on `device` (verification runs where the logits are)."""
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return DraftBatch(move(self.tokens), move(self.num_drafts), self.is_chain, move(self.depths),
                          move(self.tree_mask), move(self.children), move(self.q), move(self.start), self.kv_len,
                          self.depth)


def build_draft_batch(pending: list[int], drafts: list[Draft] | DraftTensors | None, start: list[int] | None = None,
                      to_device=None) -> DraftBatch:
    """The verify batch of these rows: pending tokens, drafts (None or all empty: no row drafted), and, given `start`
    (each row's cache length), the step's start positions. Every integer of it travels in one [B, *] long tensor
    (to_device: the decode loop's funnel, runtime/transfers.py; default: a host tensor); a tree's mask travels as one
    bit word per node (ancestors, the node itself included) and is expanded where it lands."""
    if isinstance(drafts, DraftTensors) and drafts.ids.shape[1] == 1:  # chains: a row's nodes are its draws 0 .. n-1
        return _chains_on_device(pending, drafts, start, to_device)
    if isinstance(drafts, DraftTensors):
        layout = drafts.layout()  # the rows' trees, their tokens indices into the drafts' ids
        batch = _laid_out(pending, layout, start, to_device)
        if batch.N:
            B, W, D = drafts.ids.shape
            flat, N = drafts.ids.view(B, W * D), batch.N
            q = None if drafts.q is None else drafts.q.view(B, W * D, -1)
            if batch.is_chain:  # every row's nodes are draws 0 .. n - 1 (W = 1, or one node a row): views, no copy
                batch.tokens = torch.cat([batch.tokens[:, :1], flat[:, :N]], 1)
                batch.q = None if q is None else q[:, :N]
            else:  # gathered by the nodes' indices; a tree's q has node 0 (unused) in front
                index = batch.tokens[:, 1:]
                batch.tokens = torch.cat([batch.tokens[:, :1], flat.gather(1, index)], 1)
                if q is not None:
                    nodes = q.gather(1, index[..., None].expand(-1, -1, q.shape[-1]))
                    batch.q = torch.cat([q.new_zeros(B, 1, q.shape[-1]), nodes], 1)
        return batch
    batch = _laid_out(pending, drafts, start, to_device)
    if batch.N:
        deterministic = all(map(operator.is_, map(_Q, drafts), itertools.repeat(None)))  # every q None (C loops)
        batch.q = _stack_q(drafts, None if deterministic else _check_q(drafts), len(pending), batch.N, batch.is_chain,
                           batch.num_drafts.device)
    return batch


def _chains_on_device(pending: list[int], drafts: DraftTensors, start: list[int] | None, to_device) -> DraftBatch:
    """build_draft_batch of one chain a row on the device (W = 1): what the host sends is each row's pending token,
    node count and start (no per-node layout), the nodes are the draws as they are."""
    counts = drafts.counts()
    N = max(counts, default=0)
    starts = start if start is not None else [0] * len(pending)
    packed = (to_device or torch.tensor)([[p, n, c] for p, n, c in zip(pending, counts, starts)])
    tokens = packed[:, :1] if N == 0 else torch.cat([packed[:, :1], drafts.ids[:, 0, :N]], 1)
    q = None if drafts.q is None or N == 0 else drafts.q[:, 0, :N]
    return DraftBatch(tokens, packed[:, 1], True, q=q, start=packed[:, 2] if start is not None else None,
                      kv_len=max(starts, default=0) + N + 1)


def _laid_out(pending: list[int], drafts: list[Draft] | None, start: list[int] | None, to_device) -> DraftBatch:
    """build_draft_batch's integers: the nodes' tokens, counts, tree structure and starts, in one copy (no q). No
    drafts, or none with a node: a plain step's."""
    to_device = to_device or torch.tensor
    B = len(pending)
    lens = [] if drafts is None else [len(d.tokens) for d in drafts]  # (len(d) is a Python call a row)
    N = max(lens, default=0)
    starts = start if start is not None else [0] * B
    kv_len = max(starts, default=0) + N + 1
    if N == 0:  # plain decoding: [pending, num (0), start]
        packed = to_device([[p, 0, c] for p, c in zip(pending, starts)])
        return DraftBatch(packed[:, :1], packed[:, 1], True, start=packed[:, 2] if start is not None else None,
                          kv_len=kv_len)
    zeros = [0] * N  # a short draft's padding: drafts[i] + zeros[len:] (one list for every row)
    chain = all(map(operator.eq, map(_PARENTS, drafts), map(_chain_parents, lens)))  # C loops: no call a row
    if chain:  # [pending, drafts (N), num, start]
        packed = to_device([[p, *d.tokens, *zeros[n:], n, c] for p, d, n, c in zip(pending, drafts, lens, starts)])
        batch = DraftBatch(packed[:, :N + 1], packed[:, N + 1], True)
    else:
        # a row's tree columns depend on its parents alone: worked out once per shape (most rows share a few)
        shapes = [tuple(d.parents) for d in drafts]
        W = max(map(_width, set(shapes)))
        N1 = N + 1
        packed = to_device([[p, *d.tokens, *zeros[n:], *_tree_columns(t, N, W), c]
                            for p, d, n, t, c in zip(pending, drafts, lens, shapes, starts)])
        bits = packed[:, 2 * N1 + 1:3 * N1 + 1]
        mask = (bits[:, :, None] >> torch.arange(N1, device=packed.device)) & 1 == 1  # [B, N+1, N+1]
        batch = DraftBatch(packed[:, :N1], packed[:, N1], False, packed[:, N1 + 1:2 * N1 + 1], mask,
                           packed[:, 3 * N1 + 1:3 * N1 + 1 + N1 * W].reshape(B, N1, W),
                           depth=max(max(_tree_columns(t, N, W)[1:N1 + 1]) for t in set(shapes)))
    batch.start, batch.kv_len = (packed[:, -1] if start is not None else None), kv_len
    return batch


_PARENTS, _Q = operator.attrgetter("parents"), operator.attrgetter("q")


@functools.lru_cache(maxsize=None)
def _chain_parents(n: int) -> list[int]:
    """A chain's parents, [-1, 0, .., n - 2] (Draft.is_chain without building the list per draft; never changed)."""
    return list(range(-1, n - 1))


@functools.lru_cache(maxsize=None)
def _width(parents: tuple[int, ...]) -> int:
    """The most children any node of a tree with these parents has (1 for no draft)."""
    return max((parents.count(p) for p in set(parents)), default=1)


@functools.lru_cache(maxsize=4096)
def _tree_columns(parents: tuple[int, ...], N: int, W: int) -> tuple[int, ...]:
    """A tree row's columns after its tokens: [num, depths (N+1), ancestor bits (N+1), children ((N+1) x W)]; every
    node sees the pending token and itself; padding nodes sit at depth 0 with no children. Shared, read-only."""
    N1 = N + 1
    depth, bits, kids = [0] * N1, [1 | 1 << n for n in range(N1)], [[] for _ in range(N1)]
    for j, parent in enumerate(parents):
        node, pnode = j + 1, parent + 1
        depth[node] = depth[pnode] + 1
        bits[node] |= bits[pnode]
        kids[pnode].append(node)  # siblings in token order: the order they were drawn
    return (len(parents), *depth, *bits, *(c for k in kids for c in (k + [-1] * (W - len(k)))))


def _stack_q(drafts: list[Draft], sampled, B: int, N: int, chain: bool, device):
    """The drafts' q as one [B, N (+1 for trees), V] tensor (None for deterministic drafts)."""
    if sampled is None:
        return None
    if chain and all(len(d) == N for d in drafts):  # no padding: stacked (one row: as is)
        return drafts[0].q[None] if B == 1 else torch.stack([d.q for d in drafts])
    q = sampled.new_zeros(B, N + (0 if chain else 1), sampled.shape[-1])  # rows without a draft keep zeros
    busy = [i for i, d in enumerate(drafts) if len(d)]
    lens = torch.tensor([len(drafts[i]) for i in busy])
    row = torch.tensor(busy).repeat_interleave(lens)
    col = torch.arange(int(lens.sum())) - (lens.cumsum(0) - lens).repeat_interleave(lens)
    q[row, col + (0 if chain else 1)] = torch.cat([drafts[i].q for i in busy]).to(q.device)  # one copy
    return q


def _check_q(drafts: list[Draft]):
    """The q of the first sampled draft, after checking that the batch is consistent: every non-empty
    draft carries q or none does (a missing q would read as q = 0, i.e. always accept, and bias the
    samples), and each q is [len(draft), V] with one V."""
    busy = [(i, d) for i, d in enumerate(drafts) if len(d)]
    with_q = [i for i, d in busy if d.q is not None]
    if not with_q:
        return None
    if len(with_q) != len(busy):
        without = [i for i, d in busy if d.q is None]
        raise ValueError(
            f"drafts in one batch must all carry q or none: rows {with_q[:8]} carry the distribution their "
            f"tokens were sampled from, rows {without[:8]} do not. A drafter that samples some rows and "
            "proposes others deterministically must give the deterministic rows a one-hot q "
            "(q[j] = one_hot(tokens[j])), which verification treats exactly like a deterministic draft")
    vocab = drafts[with_q[0]].q.shape[-1]
    for i, d in busy:
        shape = tuple(getattr(d.q, "shape", ()))
        if shape != (len(d), vocab):
            raise ValueError(
                f"draft {i} has {len(d)} tokens but q of shape {shape}; q must be [len(tokens), V]: one "
                f"processed distribution over the whole vocabulary (V = {vocab} in this batch) per token")
    return drafts[with_q[0]].q
