"""The paged KV cache: one pool of fixed-size blocks per layer, and a block table per row.

`k`, `v`: [layers, num_blocks, block_size, kv_heads, head_dim] (token-major inside a block, so a
row's blocks gathered side by side are already [positions, kv_heads, head_dim] and attention reads
them as a strided view with no second copy). `table`: [rows, max_blocks] long on the cache's
device; row r's position p lives at flat slot `table[r, p // block_size] * block_size +
p % block_size`. Unassigned entries point at block 0, the trash block: padding rows, padding
nodes and padded prompt positions write there, and no mask ever shows it.

Side buffers (`side`) hold other per-position data that must follow the same blocks, e.g. the target
features a learned EAGLE-3 drafter stages for its catch-up and its training data: [num_blocks,
block_size, *shape] each, addressed by the same flat slots, copied with the blocks on copy-on-write
and freed with them, so they cost memory only for the tokens actually held and a prompt's are shared
by its samples like its KV.

Which block a sequence holds is the BlockAllocator's business (plain Python, `alloc`); this class
mirrors its decisions into the device table (a few integers per changed row) and moves KV data only
for copy-on-write and tree fix-ups. Live sequences still occupy table rows 0..B-1, but compacting
them moves table rows (integers), never KV. Rejecting drafted tokens costs nothing: their keys stay
in the row's blocks past its length, no mask shows them, and blocks wholly past the length are
handed back after the step (`trim`).

Growth (the default budget, kv_budget.py): `set_ceiling` lets the allocator grow the pool when it runs
short. `_grow_pool` allocates bigger K, V and side tensors and copies every block over (block ids index
the block dimension, so the table, the allocator and every owner's blocks stay valid), then swaps them
in: every reader takes `cache.k` / `cache.v` / `cache.side` afresh at each use, and CUDA graphs, which
hold raw addresses, see `generation` change and are dropped (graphs.GraphPool.run).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable

import torch

from rlspec.rollout.runtime.blocks import TRASH, BlockAllocator
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.transfers import host_rows


def block_bytes(cfg: ModelConfig, layers: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across every layer, K and V."""
    return 2 * layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


SideSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (per-position shape, dtype)


def side_bytes(side: SideSpec | None, block_size: int) -> int:
    """Bytes of one block of every side buffer."""
    return sum(block_size * math.prod(shape) * torch.empty(0, dtype=dt).element_size()
               for shape, dt in (side or {}).values())


def gather_blocks(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """pool [num_blocks, bs, KV, D] (one layer), blocks [R, n] long -> [R, KV, n * bs, D], a strided
    view of one gathered copy (position-major), which matmuls and SDPA read as they are."""
    R, n = blocks.shape
    _, bs, KV, D = pool.shape
    return pool.index_select(0, blocks.reshape(-1)).view(R, n * bs, KV, D).transpose(1, 2)


def pool_sequence(pool: torch.Tensor) -> torch.Tensor:
    """pool [num_blocks, bs, KV, D] (one layer) -> [1, KV, num_blocks * bs, D], a view: the keys paged
    FlexAttention reads through physical block indices (attention._flex_mask)."""
    return pool.view(1, -1, *pool.shape[2:]).transpose(1, 2)


def write_slots(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """pool [num_blocks, bs, *item] (one KV layer: item = KV, D; or a side buffer); slots: flat slots of
    any shape; x [*slots.shape, *item]."""
    pool.view(-1, *pool.shape[2:])[slots.reshape(-1)] = x.reshape(-1, *pool.shape[2:])


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, rows: int, length: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device, extra_layers: int = 0, side: SideSpec | None = None):
        # extra layers after the target's belong to a learned drafter (EAGLE-3 keeps one layer of KV):
        # they live in the same blocks, so prompt sharing, preemption and tree fix-ups cover them too
        shape = (cfg.num_layers + extra_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.side_spec: SideSpec = dict(side or {})
        self.side = {name: torch.zeros(num_blocks, block_size, *shp, dtype=dt, device=device)
                     for name, (shp, dt) in self.side_spec.items()}
        self.block_size = block_size
        self.table = torch.zeros(rows, -(-length // block_size), dtype=torch.long, device=device)
        self._flat = self.table.view(-1)  # the same storage, written by position (_set)
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.generation = 0  # bumped when the pool's tensors are reallocated (growth)
        self._headroom: Callable[[], int] | None = None
        self.to_device = self.to_host = None  # the decode loop's funnel (runtime/transfers.py), given by the runner

    @classmethod
    def for_rows(cls, cfg: ModelConfig, rows: int, length: int, dtype: torch.dtype, device,
                 block_size: int = 16, extra_layers: int = 0, side: SideSpec | None = None) -> "PagedKVCache":
        """A pool of exactly rows x length positions with every row holding its blocks: the contiguous
        cache's equivalent, for a bare forward without an engine (tests, step benchmarks)."""
        per_row = -(-length // block_size)
        cache = cls(cfg, rows, length, rows * per_row + 1, block_size, dtype, device, extra_layers, side)
        cache.reserve_rows(rows, length)
        return cache

    # ---- shape ------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.table.shape[0]

    @property
    def length(self) -> int:
        """Positions a row can address (the table's width in positions)."""
        return self.table.shape[1] * self.block_size

    @property
    def layers(self) -> int:
        return self.k.shape[0]

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.rows and length <= self.length

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size() + sum(b.numel() * b.element_size() for b in self.side.values())

    def block_nbytes(self) -> int:
        """Bytes of one block: K and V of every layer plus every side buffer."""
        return self.nbytes() // self.k.shape[1]

    # ---- growth -------------------------------------------------------------------------------------
    def set_ceiling(self, max_blocks: int, headroom: Callable[[], int] | None = None) -> None:
        """Let the pool grow up to max_blocks blocks (the trash block included) when the allocator runs
        short; headroom() -> the bytes the process may still take at that moment (kv_budget.KVBudget.headroom).
        A ceiling at or below the pool's size leaves it fixed."""
        self._headroom = headroom
        self.alloc.max_blocks = max(max_blocks, self.alloc.num_blocks)
        self.alloc.grow_pool = self._grow_pool if max_blocks > self.alloc.num_blocks else None

    def _grow_pool(self, target: int) -> int:
        """The allocator's request: reallocate the pool with `target` blocks (fewer if memory allows only
        fewer now: the new tensors sit beside the old ones while blocks are copied) and copy every block.
        Returns the block count the pool has now; raises MemoryError when nothing could be allocated."""
        old, bb = self.k.shape[1], self.block_nbytes()
        if self._headroom is not None:
            room = self._headroom()
            target = min(target, room // bb)
            if target <= old:
                raise MemoryError(f"the process's memory limits (kv_budget.memory_limits) leave {room / 2**20:.1f} "
                                  f"MiB: not enough for a KV pool larger than {old} blocks ({old * bb / 2**20:.1f} "
                                  "MiB) beside the one it replaces")
        # plain tensors even if a caller holds inference mode: later in-place writes may happen outside it
        with torch.inference_mode(False):
            try:  # all new tensors first: a failure leaves the pool as it was
                new = [_grown(self.k, 1, target), _grown(self.v, 1, target)]
                side = {name: _grown(buf, 0, target) for name, buf in self.side.items()}
            except RuntimeError as e:  # the device allocator's out-of-memory (torch.OutOfMemoryError on CUDA)
                if not _out_of_memory(e):
                    raise
                raise MemoryError(str(e).splitlines()[0]) from e
            for dst, src in zip(new, (self.k, self.v)):
                dst[:, :old] = src
            for name, buf in side.items():
                buf[:old] = self.side[name]
        self.k, self.v, self.side = new[0], new[1], side
        self.generation += 1
        return target

    # ---- addressing (on the device, no host sync) ---------------------------------------------------
    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows [B], positions [B, T] long -> flat slots [B, T]; negative positions or positions past the
        table go to the trash block."""
        bs, width = self.block_size, self.table.shape[1]
        col = positions.div(bs, rounding_mode="floor")
        ok = (positions >= 0) & (col < width)
        blk = self.table[rows[:, None], col.clamp(0, width - 1)]
        return torch.where(ok, blk * bs + positions.remainder(bs), TRASH * bs)

    def step_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """slots() of table rows 0..B-1 at positions [B, T] that all lie inside the table, a step's (its rows'
        starts plus T stay within the cache's length, graphs.GraphPool.key_for; padding rows start at 0): no
        guards, five kernels of every step's graph where slots() takes ten."""
        bs = self.block_size
        return self.table[: positions.shape[0]].gather(1, positions.div(bs, rounding_mode="floor")) * bs + \
            positions.remainder(bs)

    def host_slots(self, owner: Hashable, positions: list[int]) -> list[int]:
        """slots() of one sequence's positions, on the host, from the blocks its allocator list holds (which its
        table row mirrors): for a drafter's few new positions a step, built into one tensor with its other indices
        instead of slots()' nine small ops. Negative positions and positions past the table go to the trash block,
        positions past its blocks to the trash block's slot at the same offset, as in slots()."""
        bs, width, held = self.block_size, self.table.shape[1], self.alloc.held(owner)
        return [TRASH * bs if p < 0 or p // bs >= width else (held[p // bs] if p // bs < len(held) else TRASH) * bs
                + p % bs for p in positions]

    def owner_slots(self, owner: Hashable, positions: int) -> torch.Tensor:
        """Flat slots [positions] of positions 0..positions-1 of the sequence `owner`, from the blocks it
        holds (not from a table row: a retiring sequence has left its row before its blocks are freed)."""
        bs = self.block_size
        held = torch.tensor(self.alloc.held(owner)[: -(-positions // bs)], dtype=torch.long)
        pos = torch.arange(positions)
        return (held[pos // bs] * bs + pos % bs).to(self.table.device)

    def blocks(self, B: int, S: int) -> torch.Tensor:
        """[B, ceil(S / block_size)]: the blocks rows 0..B-1 read for positions 0..S-1."""
        return self.table[:B, : -(-S // self.block_size)]

    def gather(self, layer: int, rows: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..S'-1 of the given rows, S' = S rounded up to whole blocks:
        ([R, KV, S', D], [R, KV, S', D])."""
        blocks = self.table[rows, : -(-S // self.block_size)]
        return gather_blocks(self.k[layer], blocks), gather_blocks(self.v[layer], blocks)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, KV, D] into flat slots [B, T] of one layer."""
        write_slots(self.k[layer], slots, k)
        write_slots(self.v[layer], slots, v)

    def write_side(self, name: str, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x [*slots.shape, *shape] into side buffer `name` at flat slots (trash-block slots take padding)."""
        write_slots(self.side[name], slots, x.to(self.side[name].dtype))

    def read_side(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Side buffer `name` at flat slots -> [*slots.shape, *shape] (a copy)."""
        buf = self.side[name]
        return buf.view(-1, *buf.shape[2:])[slots]

    # ---- the allocator's decisions mirrored into the table ---------------------------------------------
    def grow(self, items: list[tuple[int, Hashable, int]]) -> None:
        """(row, owner, positions): give each owner blocks for positions 0..positions-1 and enter them in
        its row. The caller checked that enough blocks can be had (alloc.needed / alloc.reserve, which grows
        a growing pool)."""
        rows, cols, blocks = [], [], []
        for row, owner, n in items:
            for col, b in self.alloc.ensure(owner, n):
                rows.append(row)
                cols.append(col)
                blocks.append(b)
        self._set(rows, cols, blocks)

    def trim(self, items: list[tuple[int, Hashable, int]]) -> None:
        """(row, owner, positions): hand back each owner's blocks past positions 0..positions-1."""
        rows, cols = [], []
        for row, owner, n in items:
            dropped = self.alloc.trim(owner, n)
            rows += [row] * len(dropped)
            cols += dropped
        self._set(rows, cols, [TRASH] * len(rows))

    def assign(self, row: int, owner: Hashable) -> None:
        """Enter owner's whole block list in `row` (admission): one small host-to-device copy."""
        held = self.alloc.held(owner)
        self.table[row] = self.ints(held + [TRASH] * (self.table.shape[1] - len(held)))

    def share_prompt(self, src_row: int, src: Hashable, dsts: list[tuple[int, Hashable]], prompt_len: int) -> None:
        """A prompt's siblings reference its full blocks (every position below the last prompt token,
        which no step ever writes again: steps write at cache_len >= prompt_len, and an EAGLE-3 drafter
        writes the last prompt position with each sample's own first token). The block holding the last
        prompt position is copied per sibling (copy-on-write, done now since every sibling writes it at
        its first step), and each gets blocks for positions 0..prompt_len (the pending token's)."""
        a = self.alloc
        full = (prompt_len - 1) // self.block_size
        src_blocks, dst_blocks = [], []
        for row, owner in dsts:
            a.share(src, owner, full)
            a.ensure(owner, prompt_len + 1)
            tail = range(full, a.blocks_for(prompt_len))
            src_blocks += [a.held(src)[i] for i in tail]
            dst_blocks += [a.held(owner)[i] for i in tail]
            self.assign(row, owner)
        self.copy_blocks(src_blocks, dst_blocks)

    def release(self, owner: Hashable) -> None:
        """A sequence finished or was preempted: its blocks go back (its row is cleared by compaction)."""
        self.alloc.free_owner(owner)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Compaction: table row src[i] now lives in row dst[i] (integers only; sources read first)."""
        if src:
            idx = self.ints([src, dst])
            self.table[idx[1]] = self.table[idx[0]]

    def clear_rows(self, start: int) -> None:
        """Rows start.. hold no sequence: point them at the trash block (graph padding rows write there)."""
        self.table[start:] = TRASH

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if src:
            s, d = self.ints([src, dst])
            for buf in (self.k, self.v):
                buf[:, d] = buf[:, s]
            for buf in self.side.values():
                buf[d] = buf[s]

    def gather_positions(self, row: int, src: list[int], dst: list[int], layers: int | None = None) -> None:
        """After tree verification: move accepted nodes' entries to consecutive positions, in the first `layers`
        layers (default all: a drafter's own layers, which its catch-up writes at the kept positions, are left)."""
        idx = self.ints([[row] * len(src), src, dst])
        s = self.slots(idx[0], idx[1][:, None])[:, 0]
        d = self.slots(idx[0], idx[2][:, None])[:, 0]
        for buf in (self.k[:layers], self.v[:layers]):
            flat = buf.view(buf.shape[0], -1, *buf.shape[3:])
            flat[:, d] = flat[:, s]

    def reset(self) -> None:
        """Every block free, every row pointing at the trash block (a new call; the pool's data, size and
        ceiling stay)."""
        self.alloc = self.alloc.fresh()
        self.table.zero_()

    def reserve_rows(self, rows: int, positions: int) -> None:
        """Give rows 0..rows-1 blocks for `positions` positions each, owned by the row index (runner-level
        use without an engine: tests, benchmarks of a bare forward)."""
        self.grow([(r, ("row", r), positions) for r in range(rows)])

    def refit(self, budget, min_positions: int, device, reserve_bytes: int = 0) -> bool:
        """Reuse this pool for a new call whose rows and length it fits (kv_budget.KVBudget): a fixed pool
        serves when it holds one sequence of min_positions; a growing one takes the call's ceiling (its own
        memory counts as usable; reserve_bytes stay back). False: allocate a new pool (its error then says what
        is missing)."""
        bb = self.block_nbytes()
        if not budget.grows:
            return self.alloc.capacity * self.block_size >= min_positions
        try:
            size = budget.pool_size(bb, self.rows, self.length, min_positions, device, held_bytes=self.nbytes(),
                                    reserve_bytes=reserve_bytes)
        except ValueError:
            return False
        self.set_ceiling(size.max_blocks, budget.ceiling_headroom(device, reserve_bytes))
        return True

    def _set(self, rows: list[int], cols: list[int], blocks: list[int]) -> None:
        """table[rows[i], cols[i]] = blocks[i]: one copy of the entries' flat positions and blocks, one write into the
        table's flat view (three ops; a [3, n] copy indexed by rows and columns took five)."""
        if rows:
            width, n = self.table.shape[1], len(rows)
            idx = self.ints([r * width + c for r, c in zip(rows, cols)] + blocks)
            self._flat[idx[:n]] = idx[n:]

    def ints(self, values) -> torch.Tensor:
        """Host integers (a list, nested for 2-D, as a long tensor; or a host tensor, as it is) on the table's device:
        through the decode loop's funnel when the runner gave one (to_device, runtime/transfers.py: no blocking
        copy), else a plain copy."""
        if self.to_device is not None:
            return self.to_device(values)
        if isinstance(values, torch.Tensor):
            return values.to(self.table.device)
        return torch.tensor(values, dtype=torch.long, device=self.table.device)

    def host_rows(self, *columns: torch.Tensor) -> list[list[float]]:
        """Device columns [B, *] read on the host, as rows: through the decode loop's funnel when the runner gave one
        (to_host, counted), else a plain copy."""
        if self.to_host is not None:
            return self.to_host(*columns).rows()
        return host_rows(*columns)


def _grown(buf: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
    """A zero tensor like buf with `blocks` entries along its block dimension `dim` (zeros: see kv_budget)."""
    shape = list(buf.shape)
    shape[dim] = blocks
    return torch.zeros(shape, dtype=buf.dtype, device=buf.device)


def _out_of_memory(e: RuntimeError) -> bool:
    """An allocator's refusal: torch.OutOfMemoryError (CUDA, recent CPU builds) or the CPU allocator's
    "can't allocate memory" RuntimeError (under RLIMIT_AS or a cgroup limit)."""
    oom = getattr(torch, "OutOfMemoryError", ())
    return isinstance(e, oom) or "can't allocate memory" in str(e) or "out of memory" in str(e).lower()
