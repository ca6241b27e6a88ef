"""The KV cache: one preallocated buffer per K and V, shaped [layers, rows, kv_heads, length, head_dim].

A sequence owns a row. Rejecting drafted tokens costs nothing: their keys stay in the buffer but
the sequence's length never advances over them, so no mask ever shows them again (gpt-fast's trick).
Live sequences occupy rows 0..B-1 so that a forward reads a view, not a gather; when sequences
finish, the survivors are compacted downwards (`move`, or `move_rows` for many rows at once).
"""
from __future__ import annotations

import torch

from rollout.runtime.model.config import ModelConfig

MOVE_CHUNK_BYTES = 256 * 2**20  # move_rows' temporary copy stays under this (a 7B model: ~57 MB per 2k-token row)


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

    def move_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Compaction of many rows at once: row src[i]'s first `length` entries now live in row dst[i].

        One indexed gather + scatter per buffer, whatever the number of rows (the engine fills the holes
        finished rows leave with rows from the tail). Sources are read in full before anything is written,
        so src and dst may overlap; dst rows must be distinct. `length` is the longest moved row's: copying
        a shorter row's stale tail is harmless, no mask ever shows it. The gathered block is
        [layers, rows, kv_heads, length, head_dim]; it goes a few layers at a time when it would be large.
        """
        if len(src) != len(dst):
            raise ValueError(f"move_rows needs as many sources as destinations, got {len(src)} and {len(dst)}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"move_rows: destination rows must be distinct, got {dst}")
        if not src or length <= 0:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        per_layer = len(src) * self.k[0, 0, :, :length].numel() * self.k.element_size()
        step = max(1, MOVE_CHUNK_BYTES // per_layer)
        for lo in range(0, self.k.shape[0], step):
            for buf in (self.k, self.v):
                buf[lo:lo + step, d, :, :length] = buf[lo:lo + step, s, :, :length]

    def gather_positions(self, row: int, src: list[int], dst: list[int]) -> None:
        """After tree verification: move accepted nodes' entries to consecutive positions."""
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, row, :, d] = self.k[:, row, :, s]
        self.v[:, row, :, d] = self.v[:, row, :, s]
