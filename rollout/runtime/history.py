"""TokenHistory: which token ids each live sequence holds, on the device, for the repetition penalty.

transformers' RepetitionPenaltyLogitsProcessor penalises every token id present in the prompt and
the completion so far (a set: how often does not matter). The engine keeps that set per block-table
row as one [rows, V] bool tensor, written where tokens are committed (prefill, resume, each decode
step's emitted tokens, all already on the device) and moved with the table's rows, so a decode step
reads it without rebuilding anything from Python lists and without a host transfer.

Under speculation each verified node needs its own history: the row's set plus the draft tokens on
the path to that node (the node itself included: its logits predict the token after it), which is
`at_nodes` (docs/verification.md#repetition-penalty-under-speculation).
"""
from __future__ import annotations

import torch


class TokenHistory:
    def __init__(self, rows: int, vocab: int, device, to_device=None):
        """to_device: the decode loop's funnel (runtime/transfers.py) row moves go through."""
        self.vocab, self.to_device = vocab, to_device
        # column V is a sink: masked-out writes go there, so scatter never races a True with a False, and
        # ids past the model's vocabulary (HF clamps them the same way) penalise nothing
        self.seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device)

    def reset(self, rows: list[int], ids: list[list[int]]) -> None:
        """Rows `rows` now hold sequences with exactly these tokens (a prefill or a resume: not per step)."""
        dev = self.seen.device
        r = torch.tensor(rows, device=dev)
        self.seen[r] = False
        row_of = torch.tensor([row for row, toks in zip(rows, ids) for _ in toks], dtype=torch.long, device=dev)
        toks = torch.tensor([t for toks in ids for t in toks], dtype=torch.long, device=dev).clamp(0, self.vocab)
        self.seen[row_of, toks] = True

    def mark(self, rows: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Add tokens [R, T] (where keep [R, T] says so) to rows [R] (device tensors, no sync)."""
        idx = tokens.clamp(0, self.vocab) if keep is None else torch.where(keep, tokens.clamp(0, self.vocab),
                                                                             self.vocab)
        self.seen[rows] = self.seen[rows].scatter(1, idx, True)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Compaction, exactly as the block table moves (kv_cache.PagedKVCache.move_rows)."""
        if src:
            idx = self.to_device([src, dst]) if self.to_device is not None else \
                torch.tensor([src, dst], device=self.seen.device)
            self.seen[idx[1]] = self.seen[idx[0]]

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, V] bool: the history of each of rows [R]."""
        return self.seen[rows, :self.vocab]

    def at_nodes(self, tokens: torch.Tensor, tree_mask: torch.Tensor | None) -> torch.Tensor:
        """The history every verified node's logits follow -> [B, N+1, V] bool, rows 0..B-1.

        tokens [B, N+1]: node 0 the pending token (already in the row's set), node j+1 draft node j.
        tree_mask [B, N+1, N+1] (node sees node: its ancestors and itself), None for chains, where
        node j sees nodes 0..j. Padding nodes see only themselves and are never reached.
        """
        B, N1 = tokens.shape
        dev = tokens.device
        if tree_mask is None:
            sees = torch.ones(N1, N1, dtype=torch.bool, device=dev).tril().expand(B, N1, N1)
        else:
            sees = tree_mask.to(dev)
        sees = sees.clone()
        sees[..., 0] = False  # the pending token is in the row's set already
        idx = torch.where(sees, tokens.clamp(0, self.vocab)[:, None, :].expand(B, N1, N1), self.vocab)
        out = self.seen[:B, None, :].expand(B, N1, self.vocab + 1).scatter(2, idx, True)
        return out[..., :self.vocab]
