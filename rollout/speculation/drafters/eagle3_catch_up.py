"""EAGLE-3's catch-up: the drafter's pass over the positions the target committed since it last ran, `propose`'s
first half, and the same pass run early, before the host reads a verify of the drafter's own drafts.

`CatchUp` is a part of Eagle3Drafter (drafters/eagle3.py), split out by what it does. It reads the drafter's network
(`model`, `fused`, `level_graphs()`), the target (`target`), the engine's KV cache (`target_cache`) and the drafter's
bookkeeping (`valid`: positions whose drafter KV is written; `committed`).

A catch-up runs positions valid..cache_len-1 of each row (the features of token t, the embedding of token t + 1),
writing the drafter's KV layer; a row's last output predicts the token after its pending one, and the proposal's
levels draw from it. Where the levels come from graphs, so does a catch-up of up to MAX_CATCH_UP_POSITIONS a row
(`DraftLevelGraphs.catch_up`, one graph per row bucket, positions bucket and context bucket): eagerly it is ~50 kernel
launches, each a few microseconds of host time that a small batch's GPU waits for.

Early. After a verify of the drafter's own proposal, each row's next catch-up covers exactly the verify's kept
nodes, and everything it needs is on the device before the host reads the step: the slots `observe_verify` staged
the features at (unkept nodes: the trash block), the emitted tokens and the accepted counts. `_catch_up_early` runs
it then, over all N + 1 nodes (a row's last output is at its accepted count), so a GPU runs it while the host waits
for the step's transfer and commits it, and the next proposal's levels start from its outputs at once.
`observe_commit` moves `valid` on for those rows; a row that committed anything since (a plain step, new weights,
a preemption) catches up as before, beside them.
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.blocks import TRASH
from rlspec.rollout.runtime.device import Span
from rlspec.rollout.runtime.model import kernels
from rlspec.rollout.runtime.model.attention import attend_dense
from rlspec.rollout.runtime.model.fused import MAX_TOKENS as FUSED_MAX_TOKENS
from rlspec.rollout.runtime.model.linear import fast_linear
from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.speculation.drafters.eagle3_graphs import MAX_CATCH_UP_POSITIONS, Held


class CatchUp:
    """The catch-up half of Eagle3Drafter's `propose`, and its early run (see the module docstring)."""

    def _catch_up(self, seqs: list[Sequence]):
        """Run the positions each sequence has not yet shown the drafter; returns its last output [B, H], which
        rows have one, and the backlog's share of the positions run (those beyond each row's latest commit). Rows
        the early catch-up covered (nothing committed since) take its outputs."""
        B, cache = len(seqs), self.target_cache
        starts = [self.valid[id(s)] for s in seqs]
        counts = [s.cache_len - st for s, st in zip(seqs, starts)]
        early, self._early = self._early, None
        # each row's index in the early run's outputs, -1 for a row that committed anything since
        ran = [early[0].get(id(s), -1) if n == 0 else -1 for s, n in zip(seqs, counts)] if early else [-1] * B
        ready = [n > 0 or i >= 0 for n, i in zip(counts, ran)]
        if early and min(ran) >= 0:  # every row from the early run; most steps: all of its rows, in its order
            return (early[1] if ran == list(range(len(early[0]))) else early[1][cache.ints(ran)]), ready, 0.0
        # read before any catch-up below is queued: a graph's outputs are its frame's, which the next replay rewrites
        mine = early[1][cache.ints([max(i, 0) for i in ran])] if early and max(ran) >= 0 else None
        backlog = sum(max(0, c - self.committed.get(id(s), 1)) for s, c in zip(seqs, counts)) / max(sum(counts), 1)
        C = max(max(counts), 1)
        last = [max(n - 1, 0) for n in counts]

        def inputs(r: int, c: int) -> torch.Tensor:
            return cache.ints(self._grid(seqs, starts, counts, r, c) + last + [0] * (r - B))

        # whole blocks are read; start + C may pass the table for a row with a short catch-up beside a long
        # one (a preempted sequence catches up from 0), but its real keys end before its own start + count
        h = self._run_catch_up(B, C, max(starts) + C, inputs, min(counts) == C)
        for seq in seqs:
            self.valid[id(seq)] = seq.cache_len
        if mine is not None:
            h = torch.where(cache.ints([i >= 0 for i in ran]).bool()[:, None], mine, h)
        return h, ready, backlog

    def _catch_up_early(self, seqs: list[Sequence], starts: list[int] | torch.Tensor, slots: torch.Tensor,
                        tokens: torch.Tensor, accepted: torch.Tensor, top: int = 0) -> None:
        """The next catch-up, run before the host reads the verify (module docstring): per row the N + 1 verified
        nodes at positions starts.., its staged slots [B, N+1] (unkept nodes: the trash block), the step's emitted
        tokens [B, N+1] (the accepted drafts, then the next token) and accepted counts [B], all on the device. The
        host lays out the rest (positions, padding) and the device writes those three in. starts on the device (a
        chain step launched ahead: `top` bounds the largest) are added there to positions laid out from 0."""
        B, n = slots.shape
        cache, ahead = self.target_cache, isinstance(starts, torch.Tensor)

        def inputs(r: int, c: int) -> torch.Tensor:
            if ahead:  # positions from 0, the same every step of this shape: laid out once, copied on the device;
                # every row as a real one (a padding row's outputs are dropped, its slots are the trash block's anyway)
                key = ("early", n, r, c)
                if key not in self._consts:
                    self._consts[key] = cache.ints(self._grid([None] * r, [0] * r, [n] * r, r, c, known=False)
                                                   + [0] * r)
                flat = self._consts[key].clone()
            else:
                flat = cache.ints(self._grid(seqs, starts, [n] * B, r, c, known=False) + [0] * r)
            grid = flat[:r * 4 * c].view(r, 4, c)
            grid[:B, 0, :n] = tokens
            grid[:B, 1, :n] = slots
            if ahead:  # RoPE positions (within the tables) and the last position each query sees
                grid[:B, 2] = (grid[:B, 2] + starts[:, None]).clamp(max=self.target.rope_cos.shape[0] - 1)
                grid[:B, 3] += starts[:, None]
            flat[r * 4 * c:r * 4 * c + B] = accepted
            return flat

        self.early_span = Span(slots.device).start()
        h = self._run_catch_up(B, n, (top if ahead else max(starts)) + n, inputs, False)
        self.early_span.stop()
        self._early = ({id(s): i for i, s in enumerate(seqs)}, h)

    def _run_catch_up(self, B: int, C: int, end: int, inputs, full: bool) -> torch.Tensor:
        """A catch-up of B rows, C queries a row, whose keys end before cache position `end`: inputs(r, c) -> on the
        device its grid [r, 4, c] flattened, then each row's last real query [r], padded to r rows and c queries
        (a graph's key; r = B, c = C eagerly); full: every row's last query is its C-th. -> last outputs [B, H]."""
        cache = self.target_cache
        S = min(-(-end // cache.block_size) * cache.block_size, cache.length)  # whole blocks
        # the fused op (a bf16 CPU) up to its token count: a long catch-up (a drafter unused for a while) is a
        # product of many rows, which oneDNN does better than our kernel
        fused = self.fused is not None and S % cache.block_size == 0 and B * C <= FUSED_MAX_TOKENS
        graphs = None if fused or C > MAX_CATCH_UP_POSITIONS else self.level_graphs()
        if graphs is not None:
            held = self._held()
            r, c, s = graphs.catch_up_key(B, C, S, held)
            return graphs.catch_up(held, inputs(r, c), (r, c), s, self._catch_up_forward)[:B]
        flat = inputs(B, C)
        out = self._catch_up_forward(flat[:B * 4 * C].view(B, 4, C), S, fused)
        # every row ran C positions: one index op fewer (most regular catch-ups)
        return out[:, C - 1] if full else out[torch.arange(B, device=flat.device), flat[B * 4 * C:]]

    def _grid(self, seqs: list[Sequence], starts: list[int], counts: list[int], rows: int, width: int,
              known: bool = True) -> list[int]:
        """A catch-up's inputs, [rows, 4, width] flattened, on the host: per row and query j its token (the embedding
        of t + 1), the slot its key goes to, its RoPE position and the last position it sees (its cached context
        and own prefix). Queries past a row's count, and rows past the sequences (a graph's padding), write to the
        trash block and are never read. One flat list, one tensor: a catch-up is a few positions a row, and each
        small op (or a nested list's conversion) costs more than its work. known=False: the rows' tokens and slots
        are left 0, for the device to write (an early catch-up's)."""
        cache, top = self.target_cache, self.target.rope_cos.shape[0] - 1
        grid, zeros = [], [0] * width
        for s, st, c in zip(seqs, starts, counts):
            pad = zeros[c:]
            if known:
                grid += s.ids(st + 1, st + 1 + c) + pad
                grid += cache.host_slots(id(s), [st + j if j < c else -1 for j in range(width)])
            else:
                grid += zeros + zeros[:c] + [TRASH * cache.block_size] * (width - c)
            grid += [min(st + j, top) for j in range(c)] + pad
            grid += range(st, st + width)
        padding = zeros + [TRASH * cache.block_size] * width + zeros + list(range(width))
        return grid + padding * (rows - len(seqs))

    def _columns(self, n: int, device) -> torch.Tensor:
        """0..n-1 on the device (made once per n): a verify's node columns."""
        if n not in self._consts:
            self._consts[n] = torch.arange(n, device=device)
        return self._consts[n]

    def _held(self) -> Held:
        """What the drafter's graphs read and write in place (eagle3_graphs.Held)."""
        cache, L = self.target_cache, self.target.cfg.num_layers
        return Held(cache.k[L], cache.v[L], cache.table, cache.side["eagle3/features"], *self._rope_tables_now(),
                    cache.block_size, cache.length)

    def _catch_up_forward(self, grid: torch.Tensor, S: int, fused: bool = False) -> torch.Tensor:
        """The drafter over a catch-up's grid [R, 4, C] on the device (table rows 0..R-1), attending over cache
        positions 0..S-1 of its KV layer, which it writes: -> outputs [R, C, H]; fused: as one op (eagle3_fused.py,
        `_run_catch_up` decides). What a catch-up graph captures (never fused)."""
        cache, L = self.target_cache, self.target.cfg.num_layers
        R, dev = grid.shape[0], grid.device
        toks, slots, pos, sees = grid.unbind(1)
        rows = torch.arange(R, device=dev)
        feats = cache.read_side("eagle3/features", slots)  # [R, C, 3H]; padding reads the trash block, masked
        visible = (torch.arange(S, device=dev) <= sees[..., None])[:, None]  # [R, 1, C, S]
        # whole blocks: read in place (the kernel, the fused op), as target steps do
        blocks = cache.table[rows, : S // cache.block_size] if S % cache.block_size == 0 else None

        def attend(q, k, v):
            cache.write(L, slots, k.transpose(1, 2), v.transpose(1, 2))
            if blocks is not None and kernels.attention_usable(q, cache.k[L]):
                return kernels.paged_attention(q, cache.k[L], cache.v[L], blocks, visible, q.shape[-1] ** -0.5)
            keys, values = cache.gather(L, rows, S)
            return attend_dense(q, keys, values, visible)

        with torch.inference_mode():
            if fused:  # one op, attending in place (eagle3_fused.py)
                return self.fused.step(fast_linear(self.model.fc, feats), self._embed(toks), *self._rope(pos),
                                       cache.k[L], cache.v[L], slots, blocks, visible)
            return self.model(feats, self._embed(toks), *self._rope(pos), attend)
