"""EAGLE-3's draws after its catch-up: chains and trees from the drafter's output, `propose`'s second half.

`ChainDraws` is a part of Eagle3Drafter (drafters/eagle3.py), split out by what it does: the drafter's own file keeps
the engine hooks, its state and the catch-up. These methods read the drafter's network (`model`), its fused ops
(`fused`, None where they do not serve this proposal), the target (`target`: its embedding and RoPE tables), the
engine's KV cache (`target_cache`) and the call's sampling state (`params`, `generator`, `history`, `stop_rule`).

A proposal draws `depth` tokens below each row's catch-up output, `width` branches at the root:
- chains on a bf16 CPU with the fused ops: the chain op (`_chain_op`, kernels/draft_chain.cpp) where it draws from
  the same law as `_pick` (docs/drafters.md#the-chain-as-one-op), else one fused layer call a step with the draws in
  Python (`_draw_steps` over `_fused_steps`);
- trees, and anywhere else: the network's steps, attending over the cached context plus the branch's own keys
  held apart (`_DraftAttention`), never written, so branches sharing a row cannot clobber each other; on a CUDA
  device every level, the layer with its draw, is replayed from a graph per row bucket, context bucket and level,
  the first draw from the catch-up's output (a tree's root children) included (`_graph_draws`, eagle3_graphs.py),
  eager elsewhere (`_draw_steps` over `_level_steps`).
Every level after the first draws from uniforms taken for all of them at once, after the first level's draw (the
same numbers, in the same order, that a draw per level takes from a CPU generator), so a graph reads them from a
buffer and the eager and graph levels draw alike; the graphs take the first level's in the eager draw's own calls.
A call with per-sample keys takes all of a proposal's uniforms from them instead (`_uniforms`, purpose DRAFT), the
same ones on every path.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from rlspec.rollout.runtime.model.fused import MAX_TOKENS as FUSED_MAX_TOKENS
from rlspec.rollout.runtime.draws import DRAFT, FINAL, bound
from rlspec.rollout.runtime.sampling import (inverse_cdf, penalise, probs_from_logits, sample,
                                             sample_without_replacement, truncates, uniform)

MAX_CONF = 0.4  # max-confidence stop rule: end the draft below this top-1 drafter probability
SVIP_BOUND = 0.3  # SVIP: end the draft when sqrt(0.15 * entropy) exceeds this


class ChainDraws:
    """The drafting half of Eagle3Drafter's `propose` (see the module docstring for the state it reads)."""

    def _confident(self, logits: torch.Tensor) -> torch.Tensor:
        """[R] bool: may the chain go on, by the arm's stop rule (docs/drafters.md#stop-rules)?"""
        probs = torch.softmax(logits, -1)
        if self.stop_rule == "max_conf":
            return probs.max(-1).values >= MAX_CONF
        entropy = -(probs * torch.log(probs.clamp(min=1e-12))).sum(-1)
        return torch.sqrt(0.15 * entropy) <= SVIP_BOUND

    def _pick(self, h: torch.Tensor, k: int, ids: torch.Tensor, seen: torch.Tensor | None = None,
              u: torch.Tensor | None = None):
        """Next tokens from drafter outputs h [R, H]: k per row -> (target ids [R, k], q [R, k, Vd] or None,
        confident [R], None without a stop rule); ids [Vd]: the draft vocabulary's target ids
        (`Eagle3Model.draft_vocab`). Greedy: the top k. Sampling
        from q, the processed distribution over the draft vocabulary (zero elsewhere, so sampling there loses
        nothing; `_draft` spreads q over the target's vocabulary once per proposal, for verification): k > 1
        draws without replacement (or i.i.d. with tree_draws="iid"); q[:, j] is the distribution draw j came
        from given the earlier ones, which is what verification needs. seen [R, V]: the history the drafted
        token follows (repetition penalty; None = off), the same as the target's node there, so q stays close
        to p. u [R, k]: the draws' uniforms, taken beforehand (a graph reads them from a buffer; None: drawn here):
        the i.i.d. draws' in row order, or the draws without replacement's one column a draw.
        """
        logits = self.model.logits(h) if self.fused is None or len(h) > FUSED_MAX_TOKENS else self.fused.logits(h)
        ok = None if self.stop_rule == "none" else self._confident(logits)
        seen = None if seen is None else seen[:, ids]
        if self.params is None or self.params.greedy:
            return ids[penalise(logits, seen, self.params).topk(k, -1).indices], None, ok
        q = probs_from_logits(logits, self.params, seen)  # [R, Vd]
        if k > 1 and self.tree_draws == "without_replacement":
            tok, qs = sample_without_replacement(q, k, self.generator, u)
            return ids[tok], qs, ok
        if k > 1:
            q = q.repeat_interleave(k, 0)  # [R*k, Vd]
        tok = sample(q, self.generator) if u is None else inverse_cdf(q, u.reshape(-1, 1))[:, 0]
        return ids[tok].view(len(h), k), q.view(len(h), k, -1), ok

    def _draft(self, seqs, h: torch.Tensor, depth: int, width: int, ahead=None):
        """Chains, `width` of them branching at the root -> (target ids [B, width, depth], q [B, width, depth, V] over
        the target's vocabulary or None for greedy drafts, nodes to keep per row [B] by the stop rule or None without
        one: a chain ends before the first token drawn from an unsure distribution, a tree's branches all at the
        shortest), all on the device. ahead (an `Ahead`): chains for a step after one the host has not read, each row
        at its length on the device, from the level graphs (Eagle3Drafter.propose_ahead)."""
        B, dev = len(seqs), h.device
        with torch.inference_mode():
            # each branch's history: its sequence's tokens (by table row: a lossy proposer may pass a subset of
            # the live rows), then the branch's own drafts
            seen = None if self.history is None else self.history.rows(self.target_cache.ints([s.row for s in seqs]))
            vocab = self._draft_vocab()
            lens = [s.cache_len for s in seqs for _ in range(width)] if ahead is None else ahead.start
            u = self._uniforms(seqs, depth, width, None if ahead is None else ahead.advance)
            if ahead is not None:  # a chain a row, no history (a look-ahead call has no repetition penalty)
                ids, q, kept = self._graph_draws(self.level_graphs(), h, depth, 1, vocab, None, lens, ahead.top, u)
            # fused steps write their keys (eagle3_fused.py); many rows are products oneDNN does better
            elif self.fused is not None and width == 1 and B <= FUSED_MAX_TOKENS:
                inputs = self._chain_inputs([id(s) for s in seqs], torch.arange(B, device=dev), lens, depth)
                if self._chain_op_serves(seen, len(vocab)):
                    ids, q, kept = self._chain_op(h, depth, vocab, inputs, u)
                else:
                    ids, q, kept = self._draw_steps(h, depth, 1, vocab, seen, self._fused_steps(inputs), u)
            elif depth > 1 and (graphs := self.level_graphs()) is not None:
                ids, q, kept = self._graph_draws(graphs, h, depth, width, vocab, seen, lens, None, u)
            else:
                rows = torch.arange(B, device=dev)  # branch -> its sequence's table row
                rows = rows if width == 1 else rows.repeat_interleave(width)
                ctx = self.target_cache.gather(self.target.cfg.num_layers, rows, max(lens))
                ids, q, kept = self._draw_steps(h, depth, width, vocab, seen, self._level_steps(ctx, lens, depth), u)
        if kept is not None and width > 1:  # every branch to the shortest
            kept = kept.view(B, width).amin(-1) * width
        ids, V = ids.view(B, width, depth), self.model.cfg.vocab_size
        if q is None or q.shape[-1] == V:  # none (greedy), or already over the target's vocabulary (the chain op)
            return ids, None if q is None else q.view(B, width, depth, V), kept
        q = q.view(B, width, depth, -1).float()  # over the draft vocabulary
        return ids, q.new_zeros(B, width, depth, V).index_copy_(3, vocab.to(q.device), q), kept

    def _uniforms(self, seqs, depth: int, width: int, advance: torch.Tensor | None = None) -> torch.Tensor | None:
        """A sampled proposal's uniforms from the call's per-sample keys: [B, depth, width], row b's (d, j) the hash
        of (its key, its completion length (+ advance [B] on the device, for a step launched ahead), DRAFT, d * width
        + j) (rollout/runtime/draws.py); None where drafts draw from the call's generator (no keys) or draw
        nothing (greedy). Keyed, a sample's drafts depend on its key and context alone, not on its batch or on how
        many levels a proposal draws; the target's uniforms (other purposes) stay independent of them."""
        if self.draws is None or self.params is None or self.params.greedy:
            return None
        mine = bound(copy.copy(self.draws), seqs, advance=advance)  # a binding of its own: the verify binds its own
        return mine.uniform((len(seqs), depth * width), DRAFT).view(len(seqs), depth, width)

    def _draft_vocab(self) -> torch.Tensor:
        """Eagle3Model.draft_vocab, made again only when d2t changed (set_draft_vocab, new weights)."""
        d2t = self.model.d2t
        if self._vocab_of != (d2t._version, d2t.data_ptr()):
            self._vocab_of, self._vocab = (d2t._version, d2t.data_ptr()), self.model.draft_vocab()
        return self._vocab

    def _chain_op_serves(self, seen, vocab: int) -> bool:
        """Whether the chain op draws from what _pick would: the processed distribution is softmax(logits / T)
        (no repetition penalty, no truncation) or greedy drafts, and the target's embedding is its plain table."""
        return seen is None and type(self.target.model.embed_tokens) is nn.Embedding and (
            self.params is None or self.params.greedy or not truncates(self.params, vocab))

    def _chain_op(self, h: torch.Tensor, depth: int, vocab: torch.Tensor, inputs: tuple, u: torch.Tensor | None = None):
        """Chains (one per row of h [R, H]) drawn in one op (FusedDraftLayer.chain, kernels/draft_chain.cpp): the
        processed distribution is softmax(logits / T) there (no penalty, no truncation; greedy: the top token).
        -> (target ids [R, depth], q [R, depth, V] over the target's vocabulary or None when greedy, nodes to
        keep [R]: the leading draws that were finite and, with a stop rule, drawn from a sure distribution)."""
        greedy = self.params is None or self.params.greedy
        # the uniforms of every draw at once
        if greedy:
            r = torch.zeros(depth, len(h))
        elif u is None:  # from the call's generator, as sample() takes them
            r = torch.rand(depth, len(h), generator=self.generator)
        else:  # keyed (`_uniforms`)
            r = u[:, :, 0].T.contiguous()
        ids, q, logits, finite = self.fused.chain(h, self.target.model.embed_tokens.weight, *inputs, vocab, r,
                                                  0.0 if greedy else float(self.params.temperature))
        ok = finite if self.stop_rule == "none" else finite & self._confident(logits)
        return ids, None if greedy else q, ok.long().cumprod(1).sum(1)

    def _first_level(self, h: torch.Tensor, depth: int, width: int, vocab: torch.Tensor, seen,
                     u: torch.Tensor | None = None):
        """The first draw below each row of h [B, H], `width` of them, and what the later levels start from:
        (first tokens [B * w], their q [B * w, Vd] or None, sure [B * w] by the stop rule or None without one, the
        history [B * w, V] with them or None, h repeated [B * w, H], the later levels' uniforms [depth - 1, B * w, 1]
        or None when greedy). u: the proposal's keyed uniforms [B, depth, width] (`_uniforms`), or None."""
        first, q_first, ok = self._pick(h, width, vocab, seen, None if u is None else u[:, 0])  # [B, w]
        tok = first.reshape(-1)  # [B*w]
        if seen is not None:
            seen = seen.repeat_interleave(width, 0).scatter(1, tok[:, None], True)
        if self.params is None or self.params.greedy or depth < 2:
            us = None
        elif u is None:
            us = uniform(self.generator, (depth - 1, len(tok), 1), h.device, FINAL)
        else:
            us = _levels(u)[1:]
        return (tok, None if q_first is None else q_first.reshape(len(tok), -1),
                None if ok is None else ok.repeat_interleave(width), seen, h.repeat_interleave(width, 0), us)

    def _draw_steps(self, h: torch.Tensor, depth: int, width: int, vocab: torch.Tensor, seen, step_fn,
                    u: torch.Tensor | None = None):
        """Chains drawn one token at a time, `width` of them below each row of h [B, H], each draft step through
        step_fn(h, embeds, j) -> (target ids [B * width, depth], q [B * width, depth, Vd] or None when greedy,
        nodes to keep [B * width] by the stop rule or None without one); u: keyed uniforms or None (`_uniforms`)."""
        tok, q_first, alive, seen, h, us = self._first_level(h, depth, width, vocab, seen, u)
        # a stop rule's bookkeeping only where one is on: without, every chain keeps its depth
        kept = None if alive is None else alive.long()
        qs = None if q_first is None else [q_first]
        out = [tok]
        for step in range(1, depth):
            h = step_fn(h[:, None], self._embed(tok[:, None]), step - 1)[:, 0]
            nxt, q, ok = self._pick(h, 1, vocab, seen, None if us is None else us[step - 1])
            if ok is not None:
                alive &= ok
                kept += alive.long()
            tok = nxt[:, 0]
            if seen is not None:
                seen = seen.scatter(1, tok[:, None], True)
            out.append(tok)
            if qs is not None:
                qs.append(q[:, 0])
        return torch.stack(out, 1), None if qs is None else torch.stack(qs, 1), kept

    def _level_steps(self, ctx: tuple, lens: list[int], depth: int):
        """Eager draft steps over the rows' cached context ctx = (keys, values) [R, KV, S, D], attending through
        `_DraftAttention`: step(h, embeds, j), j = 0 .. depth-2 for draft steps 1 .. depth-1."""
        attend = _DraftAttention(*ctx, self.target_cache.ints(lens))
        cos, sin = self._step_rope(lens, depth)
        return lambda h, embeds, j: self.model(h, embeds, cos[j], sin[j], attend)

    def _graph_draws(self, graphs, h: torch.Tensor, depth: int, width: int, vocab: torch.Tensor, seen,
                     lens: list[int] | torch.Tensor, longest: int | None = None, u: torch.Tensor | None = None):
        """`_draw_steps`' chains with their every level replayed from graphs (eagle3_graphs.py), which read the rows'
        context through the block table themselves; the first level draws from h inside a graph too, a tree's
        `width` root children a row among them. The same math on the same uniforms, taken from the generator in
        the same calls, so the same drafts. lens: each branch's length, on the host or (a chain's, with `longest`
        a host bound of the largest) on the device; u: keyed uniforms or None (`_uniforms`)."""
        sig = (None if self.params is None else (self.params.greedy, self.params.temperature, self.params.top_k,
               self.params.top_p, self.params.min_p, self.params.repetition_penalty), seen is None, self.stop_rule,
               self.tree_draws)

        def pick(hj, ids, seen_j, u, k):  # a level's draw inside its graph: k tokens a row of hj (greedy reads no u)
            nxt, q, ok = self._pick(hj, k, ids, seen_j, u)
            return nxt.reshape(-1), None if q is None else q.reshape(len(nxt) * k, -1), \
                None if ok is None else ok.repeat_interleave(k)

        B, gen, dev = len(h), self.generator, h.device
        us = None if u is None else _levels(u)
        if us is None and not (self.params is None or self.params.greedy):
            # the root's uniforms as the eager draw takes them (sample(): one call; without replacement: one call a
            # child; i.i.d. children: one call over the repeated rows), in branch order, then the later levels'
            root = uniform(gen, (1, B, 1), dev, FINAL) if width == 1 else \
                torch.stack([uniform(gen, (B, 1), dev, FINAL) for _ in range(width)], 1) \
                if self.tree_draws == "without_replacement" else uniform(gen, (B * width, 1), dev, FINAL)
            us = torch.cat([root.reshape(1, B * width, 1), uniform(gen, (depth - 1, B * width, 1), dev, FINAL)])
        if width > 1:  # each branch holds its row's output and history: the root's draw reads one a row
            h, seen = h.repeat_interleave(width, 0), None if seen is None else seen.repeat_interleave(width, 0)
        rows = [i for i in range(B) for _ in range(width)]  # branch -> its sequence's table row
        ids, q, oks = graphs.draws(self._held(), self.target_cache.ints, rows, lens, depth, width, h, seen, us, vocab,
                                   pick, self._embed, sig, longest)
        return ids, q, None if self.stop_rule == "none" else oks.long().cumprod(1).sum(1)

    def _step_rope(self, lens: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of draft steps 1..depth-1 (step j stands at position lens + j - 1), gathered for all of them at
        once: cos and sin [depth - 1, R, 1, 1, D], contiguous, so that step j's [R, 1, 1, D] is cos[j - 1]."""
        top = self.target.rope_cos.shape[0] - 1
        pos = self.target_cache.ints([[min(n + j, top) for n in lens] for j in range(depth - 1)])
        cos, sin = self._rope(pos)
        return cos[:, :, None], sin[:, :, None]

    def _chain_inputs(self, owners: list[int], rows: torch.Tensor, lens: list[int], depth: int) -> tuple:
        """What the fused draft steps of chains differ in, made for all of them at once (not ~15 small ops a step
        again: with the changes beside it, a 4-token proposal 2.55 -> 2.31 ms). Draft step j + 1 writes
        its key and value to the drafter's KV layer at position write = lens + j (past the row's table: the trash
        block, for drafts no cap keeps) and attends positions 0..write of its row. -> (cos, sin [depth - 1, R, 1,
        1, D], the drafter's K and V pools, slots [depth - 1, R], blocks [R, n], masks [depth - 1, R, 1, 1, n * bs]):
        FusedDraftLayer.chain's inputs after h."""
        cache, L = self.target_cache, self.target.cfg.num_layers
        dev, bs = cache.table.device, cache.block_size
        S, R = depth - 1, len(lens)
        if S == 0:  # a chain of one draw: no draft step, the head alone (nothing to address)
            none = torch.empty(0, R, dtype=torch.long, device=dev)
            return (*self._step_rope(lens, depth), cache.k[L], cache.v[L], none, none, none.bool())
        n = min(-(-(max(lens) + depth - 1) // bs), cache.table.shape[1])
        held = [cache.host_slots(o, [m + j for j in range(S)]) for o, m in zip(owners, lens)]  # [R][S]
        grid = [[m + j for m in lens] for j in range(S)] + [[h[j] for h in held] for j in range(S)]
        write, slots = cache.ints(grid).view(2, S, R)  # each [S, R]
        masks = (torch.arange(n * bs, device=dev) <= write[..., None])[:, :, None, None]  # [depth-1, R, 1, 1, n*bs]
        return (*self._step_rope(lens, depth), cache.k[L], cache.v[L], slots, cache.table[rows, :n], masks)

    def _fused_steps(self, inputs: tuple):
        """Draft steps of chains through the fused layer op, one call each: step(h, embeds, j) runs draft step
        j + 1 on `_chain_inputs`."""
        cos, sin, k, v, slots, blocks, masks = inputs
        return lambda h, embeds, j: self.fused.step(h, embeds, cos[j], sin[j], k, v, slots[j][:, None], blocks,
                                                    masks[j])

    def _embed(self, toks: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(toks.to(self.target.lm_head.weight.device))

    def _rope(self, pos: torch.Tensor):
        """RoPE at positions pos [...] -> cos, sin [..., 1, D] in the target's dtype."""
        cos, sin = self._rope_tables_now()
        pos = pos.to(cos.device)
        return cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)

    def _rope_tables_now(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's RoPE tables in its dtype, converted once while the target keeps the same tables."""
        if self._rope_of is not self.target.rope_cos:
            dtype = self.target.lm_head.weight.dtype
            self._rope_of = self.target.rope_cos
            self._rope_tables = (self.target.rope_cos.to(dtype), self.target.rope_sin.to(dtype))
        return self._rope_tables


class _DraftAttention:
    """Attention of the draft steps: each branch's queries over its row's cached context (keys [R, KV, S, D]
    gathered once per proposal; positions at or past the row's length `lens` [R] hidden) and over the
    branch's own earlier draft keys, which are never cached. The context is scored on its own, in float32
    converted once, so no step copies it again; on the CPU a step's attention took 104 us against 194 us
    concatenating context and draft keys into one bf16 attention (and 248 us through SDPA), 300 positions."""

    def __init__(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor, lens: torch.Tensor):
        self.k, self.v = ctx_k.float(), ctx_v.float()
        self.bias = context_bias(torch.arange(ctx_k.shape[2], device=lens.device), lens)
        self.local_k: list[torch.Tensor] = []
        self.local_v: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [R, H, T, D], this step's k, v [R, KV, T, D] -> [R, H, T, D] in q's dtype (T = 1 when drafting: a
        step's own key is its last; longer T would need a causal mask among them)."""
        self.local_k.append(k.float())
        self.local_v.append(v.float())
        return attend_apart(q, self.k, self.v, self.bias, torch.cat(self.local_k, 2), torch.cat(self.local_v, 2))


def context_bias(positions: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The mask of the rows' cached context as a float32 bias [R, 1, 1, S]: 0 below each row's length `lens` [R],
    -inf at and past it (positions [S])."""
    hidden = positions[None, :] >= lens[:, None]
    return torch.zeros(hidden.shape, device=lens.device).masked_fill(hidden, float("-inf"))[:, None, None]


def _levels(u: torch.Tensor) -> torch.Tensor:
    """Keyed uniforms [B, depth, W] (ChainDraws._uniforms) as the levels take them: [depth, B * W, 1], each level's
    in branch order (row b's branch j at b * W + j), as the generator's draws are laid out."""
    B, depth, W = u.shape
    return u.permute(1, 0, 2).reshape(depth, B * W, 1)


def attend_apart(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, bias: torch.Tensor, lk: torch.Tensor,
                 lv: torch.Tensor) -> torch.Tensor:
    """A draft step's attention: queries q [R, H, T, D] over the cached context ctx_k, ctx_v [R, KV, S, D] in
    float32 (masked by `bias`, context_bias) and over the branch's own draft keys lk, lv [R, KV, j, D] in float32,
    scored apart and softmaxed together -> [R, H, T, D] in q's dtype. The eager steps (`_DraftAttention`) and the
    level graphs (eagle3_graphs.py) both attend through it."""
    R, H, T, D = q.shape
    KV, S = ctx_k.shape[1], ctx_k.shape[2]
    qf = q.float().reshape(R, KV, H // KV * T, D) * D ** -0.5
    scores = torch.cat([qf @ ctx_k.transpose(-1, -2) + bias, qf @ lk.transpose(-1, -2)], -1)
    p = torch.softmax(scores, -1)
    out = p[..., :S] @ ctx_v + p[..., S:] @ lv
    return out.reshape(R, H, T, D).to(q.dtype)
