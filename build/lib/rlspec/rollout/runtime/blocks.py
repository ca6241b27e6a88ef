"""BlockAllocator: which fixed-size KV blocks each sequence owns. Plain Python, no tensors.

The KV pool (kv_cache.PagedKVCache) is `num_blocks` blocks of `block_size` positions each; block 0
is the trash block that every unassigned block-table entry points at (padding writes land there
and no mask ever shows it), so blocks 1..num_blocks-1 are handed out. An owner (a sequence id)
holds an ordered list of blocks: its position p lives in block `blocks[p // block_size]` at offset
`p % block_size`.

Blocks are reference counted so a prompt's n samples can hold the same full prompt blocks
(`share`); a block returns to the free list when its last holder lets go. The free list is a
stack: a block freed a moment ago is handed out next, so its memory is still warm in cache.

Growth (the default pool, kv_budget.py): the pool may start small and grow up to `max_blocks`.
`reserve(n)` asks for n free blocks; when fewer are free it calls `grow_pool(target)` (the cache
reallocates its tensors and copies every block over, so block ids stay valid) with a target at least
GROWTH times the pool, rounded up to a power of two and clamped to `max_blocks`. New blocks go to
the *bottom* of the free-list stack, so the blocks handed out are exactly those a pool allocated at
`max_blocks` from the start would hand out: growth changes memory, never which block a sequence
gets. `room` (free blocks plus what the pool may still grow by) is what the scheduler decides with;
a growth that fails (out of memory) sets `max_blocks` to the pool as it is, and the engine preempts
from then on.

Everything here is counting: the KV memory benchmark (`python -m rlspec.bench kv`) drives this same
class with no model at all, so its figures are the engine's own accounting.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

TRASH = 0  # the block unassigned table entries point at
GROWTH = 2  # a growing pool at least doubles: O(log) reallocations (each drops CUDA graphs), copies O(final)


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs; the engine preempts and retries."""


@dataclass
class BlockStats:
    peak_used: int = 0  # most blocks held at once since the last reset
    shared_refs: int = 0  # block references handed out by share() (blocks a sibling did not allocate)
    growths: int = 0  # times the pool grew since the last reset


GrowFn = Callable[[int], int]  # target block count -> block count the pool now has (>= the old one)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, max_blocks: int | None = None,
                 grow_pool: GrowFn | None = None):
        """num_blocks: the pool now (the trash block included); max_blocks: the most it may grow to (None: a
        fixed pool); grow_pool: reallocates the pool's tensors (kv_cache.PagedKVCache.set_ceiling gives it)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"a pool needs the trash block and at least one more, got {num_blocks} blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks = max(num_blocks, max_blocks or 0)
        self.grow_pool = grow_pool
        self.grow_error: str | None = None  # why the last growth failed (the pool stays as it is)
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

    @property
    def room(self) -> int:
        """Free blocks plus those the pool may still grow by: what a pool of max_blocks would have free."""
        return self.free + (self.max_blocks - self.num_blocks if self.grow_pool is not None else 0)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold positions 0..positions-1."""
        return -(-max(positions, 0) // self.block_size)

    def held(self, owner: Hashable) -> list[int]:
        return self.tables.get(owner, [])

    def needed(self, owner: Hashable, positions: int) -> int:
        """New blocks `ensure(owner, positions)` would take."""
        return max(0, self.blocks_for(positions) - len(self.held(owner)))

    # ---- growth -------------------------------------------------------------------------------------
    def reserve(self, n: int) -> int:
        """Make n blocks free if the pool may grow that far (it grows by at least GROWTH times, at most to
        max_blocks); returns the blocks free afterwards, which is < n only when n > room or growing failed."""
        short = n - self.free
        if short <= 0 or self.grow_pool is None or self.num_blocks >= self.max_blocks:
            return self.free
        # a power of two: on CUDA every pool size is a FlexAttention compile (its KV length), so few sizes
        target = min(self.max_blocks, pow2_at_least(max(self.num_blocks + short, self.num_blocks * GROWTH)))
        try:
            got = self.grow_pool(target)
        except MemoryError as e:  # the cache turns an allocator's out-of-memory into MemoryError
            self.grow_error, got = str(e), self.num_blocks
        if got <= self.num_blocks:  # nothing more can be had: decide with the pool as it is from now on
            self.max_blocks = self.num_blocks
            return self.free
        self._add_blocks(got)
        return self.free

    def _add_blocks(self, num_blocks: int) -> None:
        """Blocks num_blocks_old..num_blocks-1 join the pool, at the bottom of the free-list stack (they are
        handed out last, in ascending order: as from a pool allocated at that size from the start)."""
        self.free_list[:0] = range(num_blocks - 1, self.num_blocks - 1, -1)
        self.refs += [0] * (num_blocks - self.num_blocks)
        self.num_blocks = num_blocks
        self.stats.growths += 1

    # ---- changes ------------------------------------------------------------------------------------
    def ensure(self, owner: Hashable, positions: int) -> list[tuple[int, int]]:
        """Grow owner's blocks to cover positions 0..positions-1 (growing the pool if it may). Returns the
        new (index, block) pairs. Raises OutOfBlocks, changing nothing, when too few blocks can be had."""
        need = self.needed(owner, positions)
        if need > self.reserve(need):
            raise OutOfBlocks(f"{need} blocks needed, {self.free} free" + self._why_short())
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

    def fresh(self) -> "BlockAllocator":
        """Every block free, the same pool size, ceiling and growth (a new call)."""
        return BlockAllocator(self.num_blocks, self.block_size, self.max_blocks, self.grow_pool)

    def _why_short(self) -> str:
        return f" (the pool could not grow: {self.grow_error})" if self.grow_error else ""

    def _decref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_list.append(b)
        elif self.refs[b] < 0:
            raise RuntimeError(f"block {b} freed more often than it was held")


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(0, n - 1).bit_length()
