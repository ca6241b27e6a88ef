"""The KV cache: one preallocated buffer per K and V, shaped [layers, rows, kv_heads, length, head_dim].

A sequence owns a row. Rejecting drafted tokens costs nothing: their keys stay in the buffer but
the sequence's length never advances over them, so no mask ever shows them again (gpt-fast's trick).
Live sequences occupy rows 0..B-1 so that a forward reads a view, not a gather; when sequences
finish, the survivors are compacted downwards (`move`).
"""
from __future__ import annotations

import torch

from rollout.runtime.model.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, rows: int, length: int, dtype: torch.dtype, device, extra_layers: int = 0):
        # extra layers after the target's belong to a learned drafter (EAGLE-3 keeps one layer of KV),
        # so compaction, prompt sharing and tree fix-ups move its entries along with the target's
        shape = (cfg.num_layers + extra_layers, rows, cfg.num_kv_heads, length, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[3]

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.rows and length <= self.length

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy_row(self, src: int, dsts: list[int], length: int) -> None:
        """Share a prefilled prompt: copy its first `length` entries into other rows."""
        if dsts:
            idx = torch.tensor(dsts, device=self.k.device)
            self.k[:, idx, :, :length] = self.k[:, src : src + 1, :, :length]
            self.v[:, idx, :, :length] = self.v[:, src : src + 1, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Compaction: row src's first `length` entries now live in row dst."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def gather_positions(self, row: int, src: list[int], dst: list[int]) -> None:
        """After tree verification: move accepted nodes' entries to consecutive positions."""
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, row, :, d] = self.k[:, row, :, s]
        self.v[:, row, :, d] = self.v[:, row, :, s]
