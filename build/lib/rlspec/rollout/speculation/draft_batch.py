"""Turn per-sequence drafts into the padded tensors one verify forward needs.

Node 0 of every row is the sequence's pending token; node j+1 is draft node j. Rows are padded to
the largest draft; padding nodes have no parent link, so they are never reachable in verification
and their KV (written past the sequence's length) is never shown again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlspec.rollout.speculation.drafters.base import Draft


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
    # deterministic drafts. Padding rows and nodes hold zeros and are never reached.
    q: torch.Tensor | None = None

    def to(self, device) -> "DraftBatch":
        """The same batch with every tensor on `device` (verification runs where the logits are)."""
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return DraftBatch(move(self.tokens), move(self.num_drafts), self.is_chain, move(self.depths),
                          move(self.tree_mask), move(self.children), move(self.q))


def build_draft_batch(pending: list[int], drafts: list[Draft]) -> DraftBatch:
    B, N = len(drafts), max((len(d) for d in drafts), default=0)
    tokens = torch.tensor([[p, *d.tokens] + [0] * (N - len(d)) for p, d in zip(pending, drafts)], dtype=torch.long)
    num = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    sampled = _check_q(drafts)
    chain = all(d.is_chain for d in drafts)
    q = None
    if sampled is not None and chain and all(len(d) == N for d in drafts):  # no padding: stacked (one row: as is)
        q = drafts[0].q[None] if B == 1 else torch.stack([d.q for d in drafts])
    elif sampled is not None:  # rows without a draft keep zeros: they are out of range in verify
        q = sampled.new_zeros(B, N + (0 if chain else 1), sampled.shape[-1])
        busy = [i for i, d in enumerate(drafts) if len(d)]
        lens = num[busy]
        row = torch.tensor(busy).repeat_interleave(lens)
        col = torch.arange(int(lens.sum())) - (lens.cumsum(0) - lens).repeat_interleave(lens)
        q[row, col + (0 if chain else 1)] = torch.cat([drafts[i].q for i in busy]).to(q.device)  # one copy
    if chain:
        return DraftBatch(tokens, num, True, q=q)
    W = max(max((d.parents.count(p) for p in set(d.parents)), default=1) for d in drafts)
    depths = torch.zeros(B, N + 1, dtype=torch.long)
    mask = torch.eye(N + 1, dtype=torch.bool).repeat(B, 1, 1)
    mask[:, :, 0] = True  # every node sees the pending token
    children = torch.full((B, N + 1, W), -1, dtype=torch.long)
    for i, d in enumerate(drafts):
        fill = [0] * (N + 1)
        for j, parent in enumerate(d.parents):
            node, pnode = j + 1, parent + 1
            depths[i, node] = depths[i, pnode] + 1
            mask[i, node] |= mask[i, pnode]
            children[i, pnode, fill[pnode]] = node  # siblings in token order: the order they were drawn
            fill[pnode] += 1
    return DraftBatch(tokens, num, False, depths, mask, children, q)


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
