"""KVLedger: which blocks a generate call's sequences hold, step by step (no forwards, no drafters).

The engine's loop and `python -m rlspec.bench kv` (which replays a rollout's scheduling with no model
to measure memory) both keep their books through this class, so the benchmark's figures are the
engine's own accounting rather than a copy of it. Plain Python over the Scheduler and the cache's
allocator and block table; the forwards and the drafters' hooks stay in the engine (`on_evict`,
`on_finish` callbacks).

The order of one call, as the engine runs it:
  admit -> blocks for fresh prompts (the head sample) -> prefill -> share the prompt with its siblings
        -> blocks for resumed sequences -> re-prefill
  step  -> make_room (preempt the youngest until every live pending token has a block)
        -> draft_room (blocks for drafted positions while they last) -> forward, verify, commit
        -> trim (rejected drafts hold at most a spare block past their step) -> retire (free, compact rows)
"""
from __future__ import annotations

from collections.abc import Callable

from rlspec.rollout.runtime.kv_cache import PagedKVCache
from rlspec.rollout.runtime.scheduler import Scheduler, draft_room
from rlspec.rollout.runtime.sequence import Sequence


class KVLedger:
    def __init__(self, cache: PagedKVCache, sched: Scheduler, followers: tuple = ()):
        """followers: per-row device state kept aligned with the block table (a TokenHistory): every
        row compaction applied to the table is applied to them too (`move_rows(src, dst)`)."""
        self.cache, self.sched, self.followers = cache, sched, tuple(followers)
        self.grown: set[int] = set()  # owners draft_room gave blocks this step (trim looks at them only)
        self.spares: set[int] = set()  # owners trim left a spare block (make_room takes it back under pressure)

    def _move_rows(self, src: list[int], dst: list[int]) -> None:
        for t in (self.cache, *self.followers):
            t.move_rows(src, dst)

    def prompt_blocks(self, fresh: list[list[Sequence]]) -> None:
        """Each fresh group's head sample gets blocks for its prompt and its pending token."""
        self.cache.grow([(g[0].row, id(g[0]), len(g[0].prompt_ids) + 1) for g in fresh])

    def share_prompts(self, fresh: list[list[Sequence]]) -> None:
        """After the prefill: the siblings reference the head's full prompt blocks (copy-on-write tail)."""
        for g in fresh:
            self.cache.share_prompt(g[0].row, id(g[0]), [(s.row, id(s)) for s in g[1:]], len(g[0].prompt_ids))

    def resume_blocks(self, seqs: list[Sequence]) -> None:
        """Readmitted preempted sequences get fresh blocks for everything they hold and their pending token."""
        self.cache.grow([(s.row, id(s), s.cache_len + 1) for s in seqs])

    def make_room(self, on_evict: Callable[[Sequence], None] = lambda s: None, preempt: bool = True) -> bool:
        """Preempt the youngest until every live sequence's pending token has a block, then take those. With
        preempt=False, where someone would have to go: False, and no block taken (the caller steps back to the
        loop, whose make_room preempts)."""
        cache, sched = self.cache, self.sched
        tables, bs = cache.alloc.tables, cache.block_size
        # the rows whose pending position has no block yet: a row crosses into a new block once in block_size steps
        short = [s for s in sched.live if len(tables.get(id(s), ())) * bs <= s.cache_len]
        if not short:
            return True
        # only the short rows need blocks, so when theirs fit, Scheduler.make_room would preempt no one: the
        # usual case, checked without its pass over every live row
        if not sched.fits(sum(cache.alloc.needed(id(s), s.cache_len + 1) for s in short)):
            if not preempt:
                return False
            if self.spares:
                self._trim(sched.live, 0)  # spare blocks go back before anyone is preempted
            victims = sched.make_room()
            for victim, moves in victims:  # moves of successive removals: applied in order
                on_evict(victim)
                self._move_rows([m[0] for m in moves], [m[1] for m in moves])
            if victims:
                cache.clear_rows(len(sched.live))
        cache.grow([(s.row, id(s), s.cache_len + 1) for s in short if s.row >= 0])  # victims hold no row
        return True

    def due_for_blocks(self, step: int) -> list[bool]:
        """For a run of one-token steps from decode step `step` on, each row's pending position within its blocks
        (after make_room): due[n % block_size] says whether some live row's position crosses into a new block at
        step n. A row given that block crosses again block_size steps later, so a run asks make_room only on the
        steps due."""
        tables, bs = self.cache.alloc.tables, self.cache.block_size
        due = [False] * bs
        for s in self.sched.live:
            due[(step + len(tables.get(id(s), ())) * bs - s.cache_len) % bs] = True
        return due

    def draft_room(self, live: list[Sequence], caps: list[int], lens: list[int] | None = None) -> list[int]:
        """Blocks for each row's drafted positions while the pool lasts; returns the caps kept. lens: the rows' cache
        lengths, where the caller has them."""
        lens = [s.cache_len for s in live] if lens is None else lens
        kept, short = draft_room(self.cache.alloc, live, caps, lens)
        grow = [(live[i].row, id(live[i]), lens[i] + 1 + kept[i]) for i in short]
        if grow:
            self.cache.grow(grow)
            self.grown.update(owner for _, owner, _ in grow)
        return kept

    def trim(self, live: list[Sequence]) -> None:
        """After commit: hand back blocks past each unfinished sequence's pending position, but one: the block its
        next positions enter stays with it (a spare), so a row drafting across a block boundary does not take and
        hand back the same block step after step. Spares go back before make_room preempts anyone."""
        if not self.grown:  # only rows given draft blocks this step can hold one past their pending position
            return
        grown = {id(s) for s in live if id(s) in self.grown and not s.finished}
        self.grown.clear()
        self._trim([s for s in live if id(s) in grown], self.cache.block_size)
        self.spares |= grown

    def _trim(self, seqs: list[Sequence], spare: int) -> None:
        """Blocks past each sequence's pending position + `spare` positions go back."""
        tables, bs = self.cache.alloc.tables, self.cache.block_size
        self.cache.trim([(s.row, id(s), n) for s in seqs
                         if len(tables.get(id(s), ())) * bs >= (n := s.cache_len + 1 + spare) + bs])  # a block past n
        if spare == 0:
            self.spares.clear()

    def retire(self, on_finish: Callable[[Sequence], None] = lambda s: None) -> list[Sequence]:
        """Finished sequences leave (on_finish runs while they still hold their blocks); survivors' rows
        fill the holes and rows past the live batch point at the trash block. Returns the finished."""
        finished, moves = self.sched.retire()
        for s in finished:
            on_finish(s)
            self.cache.release(id(s))
        if finished:
            self._move_rows([m[0] for m in moves], [m[1] for m in moves])
            self.cache.clear_rows(len(self.sched.live))
        return finished
