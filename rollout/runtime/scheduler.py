"""Scheduler: which sequences are live, in which block-table rows, and who waits. Plain Python.

Admission: prompt groups (a prompt's n samples, which share one prefill and the prompt's full KV
blocks) are admitted whole while table rows and KV blocks last (`group_blocks` is what a group
costs, plus the blocks each live sequence grows into over its next HEADROOM_TOKENS tokens: one block
of 16 positions, none of 128 for a row that stays inside its block); when nothing is live and the
first group still does not fit, as many of its samples as fit are admitted (the rest wait as a
smaller group with a prefill of its own), so a pool that holds one sequence always makes progress.

Growth: every decision asks `fits` (or `alloc.reserve`), which grows a growing pool (the default
budget) before saying no, so the decisions are those of a pool allocated at its ceiling.

Preemption: when a step needs more blocks than are free and the pool may grow no more, the youngest
sequences (latest first admission) give theirs back (`preempt`) and wait at the front of the queue,
oldest first; on readmission a prefill of what they hold recomputes their KV. Only the scheduling
changes, never a sequence's own draws (docs/runtime.md#preemption says why the law is unchanged).

Rows: live sequences occupy rows 0..B-1. When sequences leave (finished or preempted), the
survivors with the highest rows fill the holes (`remove` returns those moves for the block table);
the live list is kept sorted by row, which is the order every batch tensor uses.
"""
from __future__ import annotations

from collections import deque

from rlspec.rollout.runtime.blocks import BlockAllocator
from rlspec.rollout.runtime.sequence import Sequence

# positions of growth kept free per live sequence at admission (a block's worth where blocks are smaller):
# admitting into the last free blocks would only preempt someone a few steps later. Counted in positions, not
# blocks: with FlexAttention's 128-position blocks (CUDA) a block of headroom per row halved the rows that a pool of
# one block a row admits (bench_out/gpu_2026-11-30/: 7B, 128 rows of 96 positions ran as two waves of 64)
HEADROOM_TOKENS = 16


class Scheduler:
    def __init__(self, groups: list[list[Sequence]], rows: int, alloc: BlockAllocator):
        self.waiting: deque[list[Sequence]] = deque(groups)
        self.live: list[Sequence] = []
        self.rows, self.alloc = rows, alloc
        self.admitted = 0  # first-admission counter: a sequence's age
        self.preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.live)

    def group_blocks(self, g: list[Sequence]) -> int:
        """Blocks admitting g takes: a resumed sequence its whole prefix + the pending token; a fresh group
        the prompt + the first pending position once, and for each further sample everything but the full
        blocks it shares (kv_cache.PagedKVCache.share_prompt)."""
        a = self.alloc
        if g[0].resumed:
            return a.blocks_for(g[0].cache_len + 1)
        n = len(g[0].prompt_ids)
        own = a.blocks_for(n + 1)
        return own + (len(g) - 1) * (own - (n - 1) // a.block_size)

    def admit(self) -> list[list[Sequence]]:
        """Pop the waiting groups that fit the free rows and blocks; give their sequences rows B, B+1, ...
        Blocks are not taken here: the engine takes them as it prefills (kv_cache.grow / share_prompt).
        A growing pool grows to hold what is admitted (`fits`): admission is that of a pool at its ceiling."""
        if not self.admits():  # every decode step asks: nothing waits, or the first group finds no rows (no pass)
            return []
        groups, promised = [], 0  # blocks the groups admitted so far will take
        # headroom: the blocks every live sequence grows into over its next HEADROOM_TOKENS tokens (see there),
        # summed once and then kept as groups join (a sum over the live batch for each group was quadratic: 72
        # million calls to admit 12,000 one-sample groups). An empty engine takes what fits without it: it must
        # make progress
        growth = sum(map(self._growth, self.live))
        while self.waiting:
            g = self.waiting[0]
            empty = not self.live and not groups
            cost = self.group_blocks(g) + (0 if empty else growth + sum(map(self._growth, g)))
            if len(self.live) + len(g) <= self.rows and self.fits(promised + cost):
                self.waiting.popleft()
            elif empty and len(g) > 1:
                g = self._split_front()  # an empty engine must make progress
            else:
                break
            promised += self.group_blocks(g)
            growth += sum(map(self._growth, g))
            for s in g:
                if s.admit_order < 0:
                    s.admit_order = self.admitted
                    self.admitted += 1
                s.row = len(self.live)
                self.live.append(s)
            groups.append(g)
        return groups

    def admits(self) -> bool:
        """Whether admit() would admit a group now, admitting none: its first group's test (the check of the blocks
        may grow the pool, as admit's does: the same pool either way). The usual answers need no pass over the live
        batch: nothing waits, or the first group needs more rows than are free (a GRPO rollout's usual state)."""
        if not self.waiting:
            return False
        if not self.live:
            return True  # an empty engine takes what fits, at least one sample
        g = self.waiting[0]
        if len(self.live) + len(g) > self.rows:
            return False
        return self.fits(self.group_blocks(g) + sum(map(self._growth, self.live)) + sum(map(self._growth, g)))

    def _growth(self, s: Sequence) -> int:
        """Blocks s takes beyond those it holds (its cache and pending position; a fresh one's prompt and first
        position) to hold its next HEADROOM_TOKENS tokens, or a block's worth where blocks are smaller: 1 with blocks
        of up to 16 positions (as it always was), 0 or 1 with 128-position ones."""
        held, a = max(s.cache_len, len(s.prompt_ids)) + 1, self.alloc
        return a.blocks_for(held + min(a.block_size, HEADROOM_TOKENS)) - a.blocks_for(held)

    def fits(self, blocks: int) -> bool:
        """Whether `blocks` blocks can be free: within the pool's room, growing it if needed (and possible)."""
        return blocks <= self.alloc.room and self.alloc.reserve(blocks) >= blocks

    def _split_front(self) -> list[Sequence]:
        """The largest prefix of the first waiting group that fits rows and blocks (at least one sample)."""
        g = self.waiting[0]
        k = min(len(g), self.rows)
        while k > 1 and not self.fits(self.group_blocks(g[:k])):
            k -= 1
        self.waiting[0] = g[k:]
        return g[:k]

    def make_room(self) -> list[tuple[Sequence, list[tuple[int, int]]]]:
        """Grow the pool if it may, else preempt the youngest live sequences (their blocks go back to the
        pool), until every one left has a block for its pending position. Returns (victim, row moves) in
        the order they happened."""
        out = []
        while not self.fits(sum(self.alloc.needed(id(s), s.cache_len + 1) for s in self.live)):
            victim = self.youngest()
            if victim is None:  # the engine checked that the pool can hold one sequence of the call
                raise RuntimeError("KV pool exhausted by a single sequence" + (
                    f": the pool could not grow ({self.alloc.grow_error})" if self.alloc.grow_error
                    else " (a KV accounting bug)"))
            self.alloc.free_owner(id(victim))
            out.append((victim, self.preempt(victim)))
        return out

    def youngest(self, keep: int = 1) -> Sequence | None:
        """The live sequence admitted last, unless only `keep` are live."""
        if len(self.live) <= keep:
            return None
        return max(self.live, key=lambda s: s.admit_order)

    def preempt(self, s: Sequence) -> list[tuple[int, int]]:
        """s leaves the live batch and waits at the front (behind older preempted ones); returns row moves."""
        s.resumed = True
        self.preemptions += 1
        queued = [g for g in self.waiting if g[0].resumed]
        pos = sum(1 for g in queued if g[0].admit_order < s.admit_order)
        self.waiting.insert(pos, [s])
        return self.remove([s])

    def retire(self) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """Drop finished sequences; returns (finished, moves) with moves (src row, dst row) that the block
        table must apply so the survivors occupy rows 0..B-1 again."""
        finished = [s for s in self.live if s.finished]
        return finished, self.remove(finished) if finished else []

    def remove(self, gone: list[Sequence]) -> list[tuple[int, int]]:
        """Take `gone` out of the live batch; the highest survivors fill the holes below B."""
        ids = {id(s) for s in gone}
        survivors = [s for s in self.live if id(s) not in ids]
        B = len(survivors)
        holes = sorted(s.row for s in gone if s.row < B)
        movers = sorted((s for s in survivors if s.row >= B), key=lambda s: s.row)
        moves = []
        for hole, s in zip(holes, movers):
            moves.append((s.row, hole))
            s.row = hole
        for s in gone:
            s.row = -1
        self.live = sorted(survivors, key=lambda s: s.row)
        return moves


def draft_room(alloc: BlockAllocator, live: list[Sequence], caps: list[int],
               lens: list[int]) -> tuple[list[int], list[int]]:
    """Drafted positions each live sequence may write this step (past its pending token), at most caps[i]:
    what its blocks hold plus the free blocks (a growing pool grows for them first), handed out oldest
    sequence first. Where the pool runs short a draft is shortened (which changes speed, never the law).
    lens: the rows' cache lengths. Returns the caps kept and the rows whose kept positions need blocks they do not
    hold (the caller takes them)."""
    bs, tables = alloc.block_size, alloc.tables
    held = [len(tables.get(id(s), ())) for s in live]
    short = [i for i, (n, h, c) in enumerate(zip(lens, held, caps)) if n + 1 + c > h * bs]
    if not short:  # every draft fits the blocks its row holds (most steps)
        return caps, short
    need = {i: -(-(lens[i] + 1 + caps[i]) // bs) - held[i] for i in short}
    free, kept = alloc.reserve(min(sum(need.values()), alloc.room)), list(caps)
    for i in sorted(short, key=lambda i: live[i].admit_order):
        extra = min(need[i], free)
        kept[i] = min(caps[i], (held[i] + extra) * bs - lens[i] - 1)
        free -= extra
    return kept, [i for i in short if lens[i] + 1 + kept[i] > held[i] * bs]
