"""BlockAllocator: which fixed-size KV blocks each sequence owns. Plain Python, no tensors.

The KV pool (kv_cache.PagedKVCache) is `num_blocks` blocks of `block_size` positions each; block 0
is the trash block that every unassigned block-table entry points at (padding writes land there
and no mask ever shows it), so blocks 1..num_blocks-1 are handed out. An owner (a sequence id)
holds an ordered list of blocks: its position p lives in block `blocks[p // block_size]` at offset
`p % block_size`.

Blocks are reference counted so a prompt's n samples can hold the same full prompt blocks
(`share`); a block returns to the free list when its last holder lets go. The free list is a
stack: a block freed a moment ago is handed out next, so its memory is still warm in cache.

Everything here is counting: the KV memory benchmark (scripts/bench_kv_memory.py) drives this same
class with no model at all, so its figures are the engine's own accounting.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

TRASH = 0  # the block unassigned table entries point at


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs; the engine preempts and retries."""


@dataclass
class BlockStats:
    peak_used: int = 0  # most blocks held at once since the last reset
    shared_refs: int = 0  # block references handed out by share() (blocks a sibling did not allocate)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"a pool needs the trash block and at least one more, got {num_blocks} blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.free_list = list(range(num_blocks - 1, TRASH, -1))  # pops 1, 2, 3, ... first
        self.tables: dict[Hashable, list[int]] = {}
        self.stats = BlockStats()

    # ---- counting ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks that can be handed out (all but the trash block)."""
        return self.num_blocks - 1

    @property
    def free(self) -> int:
        return len(self.free_list)

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold positions 0..positions-1."""
        return -(-max(positions, 0) // self.block_size)

    def held(self, owner: Hashable) -> list[int]:
        return self.tables.get(owner, [])

    def needed(self, owner: Hashable, positions: int) -> int:
        """New blocks `ensure(owner, positions)` would take."""
        return max(0, self.blocks_for(positions) - len(self.held(owner)))

    # ---- changes ------------------------------------------------------------------------------------
    def ensure(self, owner: Hashable, positions: int) -> list[tuple[int, int]]:
        """Grow owner's blocks to cover positions 0..positions-1. Returns the new (index, block) pairs.
        Raises OutOfBlocks, changing nothing, when too few blocks are free."""
        need = self.needed(owner, positions)
        if need > self.free:
            raise OutOfBlocks(f"{need} blocks needed, {self.free} free")
        table = self.tables.setdefault(owner, [])
        new = []
        for _ in range(need):
            b = self.free_list.pop()
            self.refs[b] = 1
            new.append((len(table), b))
            table.append(b)
        self.stats.peak_used = max(self.stats.peak_used, self.used)
        return new

    def trim(self, owner: Hashable, positions: int) -> list[int]:
        """Let go of owner's blocks past those covering positions 0..positions-1 (rejected drafts).
        Returns the table indices that no longer hold a block."""
        table = self.tables.get(owner, [])
        keep = self.blocks_for(positions)
        dropped = list(range(keep, len(table)))
        for b in table[keep:]:
            self._decref(b)
        del table[keep:]
        return dropped

    def free_owner(self, owner: Hashable) -> int:
        """A sequence finished or was preempted: release every block it holds. Returns how many it held."""
        table = self.tables.pop(owner, [])
        for b in table:
            self._decref(b)
        return len(table)

    def share(self, src: Hashable, dst: Hashable, full_blocks: int) -> list[int]:
        """dst (holding nothing yet) references src's first `full_blocks` blocks (reference counted;
        nobody writes them again). Returns them."""
        if self.tables.get(dst):
            raise ValueError(f"share: {dst!r} already holds blocks")
        blocks = self.tables[src][:full_blocks]
        for b in blocks:
            self.refs[b] += 1
        self.tables[dst] = list(blocks)
        self.stats.shared_refs += len(blocks)
        return blocks

    def reset_stats(self) -> None:
        self.stats = BlockStats(peak_used=self.used)

    def _decref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_list.append(b)
        elif self.refs[b] < 0:
            raise RuntimeError(f"block {b} freed more often than it was held")
