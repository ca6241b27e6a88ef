"""Scheduler: which sequences hold which KV-cache rows. Plain Python, no tensors.

Live sequences always occupy rows 0..B-1, so a forward reads a view of the cache, never a gather.
Prompt groups (a prompt's n samples, which share one prefill) are admitted whole while rows are
free. When sequences finish, their rows become holes below B; the survivors with the highest rows
fill them (`retire` returns those moves for the cache to execute). Each finished row costs at most
one row move, O(finished) per step rather than O(batch) for an order-keeping compaction; the
live list is kept sorted by row, which is the order every batch tensor uses.
"""
from __future__ import annotations

from collections import deque

from rollout.runtime.sequence import Sequence


class Scheduler:
    def __init__(self, groups: list[list[Sequence]], rows: int):
        self.waiting: deque[list[Sequence]] = deque(groups)
        self.live: list[Sequence] = []
        self.rows = rows

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.live)

    def admit(self) -> list[list[Sequence]]:
        """Pop the waiting groups that fit the free rows and give their sequences rows B, B+1, ..."""
        groups = []
        while self.waiting and len(self.live) + len(self.waiting[0]) <= self.rows:
            g = self.waiting.popleft()
            for s in g:
                s.row = len(self.live)
                self.live.append(s)
            groups.append(g)
        return groups

    def retire(self) -> tuple[list[Sequence], list[tuple[int, int, int]]]:
        """Drop finished sequences; returns (finished, moves) with moves (src row, dst row, length)
        that the KV cache must apply so the survivors occupy rows 0..B-1 again."""
        finished = [s for s in self.live if s.finished]
        if not finished:
            return [], []
        survivors = [s for s in self.live if not s.finished]
        B = len(survivors)
        holes = sorted(s.row for s in finished if s.row < B)
        movers = sorted((s for s in survivors if s.row >= B), key=lambda s: s.row)
        moves = []
        for hole, s in zip(holes, movers):
            moves.append((s.row, hole, s.cache_len))
            s.row = hole
        self.live = sorted(survivors, key=lambda s: s.row)
        return finished, moves
