"""Turn per-sequence drafts into the padded tensors one verify forward needs.

Node 0 of every row is the sequence's pending token; node j+1 is draft node j. Rows are padded to
the largest draft; padding nodes have no parent link, so they are never reachable in verification
and their KV (written past the sequence's length) is never shown again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.spec.drafters.base import Draft


@dataclass
class DraftBatch:
    tokens: torch.Tensor  # [B, N+1] long: pending token, then draft nodes
    num_drafts: torch.Tensor  # [B] long
    is_chain: bool
    depths: torch.Tensor | None = None  # [B, N+1] long RoPE offsets (trees only)
    tree_mask: torch.Tensor | None = None  # [B, N+1, N+1] bool, node may see node (trees only)
    children: torch.Tensor | None = None  # [B, N+1, W] long child node indices, -1 none (trees only)
    # sampled drafts: chains [B, N, V] the distribution of each draft; trees [B, N+1, V] the
    # distribution each node's children were drawn from. None for deterministic drafts.
    q: torch.Tensor | None = None

    def to(self, device) -> "DraftBatch":
        """The same batch with every tensor on `device` (verification runs where the logits are)."""
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return DraftBatch(move(self.tokens), move(self.num_drafts), self.is_chain, move(self.depths),
                          move(self.tree_mask), move(self.children), move(self.q))


def build_draft_batch(pending: list[int], drafts: list[Draft]) -> DraftBatch:
    B, N = len(drafts), max((len(d) for d in drafts), default=0)
    tokens = torch.zeros(B, N + 1, dtype=torch.long)
    tokens[:, 0] = torch.tensor(pending, dtype=torch.long)
    for i, d in enumerate(drafts):
        if len(d):
            tokens[i, 1:1 + len(d)] = torch.tensor(d.tokens, dtype=torch.long)
    num = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    sampled = next((d.q for d in drafts if d.q is not None), None)
    if all(d.is_chain for d in drafts):
        q = None
        if sampled is not None:  # rows without a draft keep zeros: they are out of range in verify
            q = sampled.new_zeros(B, N, sampled.shape[-1])
            for i, d in enumerate(drafts):
                if d.q is not None and len(d):
                    q[i, :len(d)] = d.q
        return DraftBatch(tokens, num, True, q=q)
    W = max(max((d.parents.count(p) for p in set(d.parents)), default=1) for d in drafts)
    depths = torch.zeros(B, N + 1, dtype=torch.long)
    mask = torch.eye(N + 1, dtype=torch.bool).repeat(B, 1, 1)
    mask[:, :, 0] = True  # every node sees the pending token
    children = torch.full((B, N + 1, W), -1, dtype=torch.long)
    q = None if sampled is None else sampled.new_zeros(B, N + 1, sampled.shape[-1])
    for i, d in enumerate(drafts):
        fill = [0] * (N + 1)
        for j, parent in enumerate(d.parents):
            node, pnode = j + 1, parent + 1
            depths[i, node] = depths[i, pnode] + 1
            mask[i, node] |= mask[i, pnode]
            children[i, pnode, fill[pnode]] = node
            fill[pnode] += 1
            if q is not None and d.q is not None:
                q[i, pnode] = d.q[j]  # the node's children were drawn from its distribution
    return DraftBatch(tokens, num, False, depths, mask, children, q)
