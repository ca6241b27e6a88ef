"""The learned EAGLE-3 drafter inside the engine: catch up on the target's features, then draft.

Per sequence the drafter keeps one layer of KV in the engine's paged cache (an extra layer of the
same blocks, so sharing, preemption and tree fix-ups cover it) and the target features of every cached
position, staged in side buffers of the same blocks (kv_cache.py): they cost memory only for the tokens
held, a prompt's are shared by its samples, and they go with the blocks when a sequence finishes or is
preempted (the engine's re-prefill of a preempted sequence stages them again). Each step:
1. catch-up: run positions valid..cache_len-1 (features of token t, embedding of token t+1),
   writing the drafter's KV; the last output predicts the token after the pending one;
2. draft: feed the drafter's own output back for depth-1 more steps. These speculative steps attend
   over the cached context plus their own keys held locally, never written, so tree branches
   sharing a row cannot clobber each other and rejected drafts leave nothing behind. Chains on a bf16
   CPU run both stages as one fused op a step (eagle3_fused.py); their draft keys go to the drafter's
   KV layer at the positions they stand for, which the next catch-up rewrites before any step reads
   them as context.
At temperature 0 drafts are greedy (top-w at the root for trees) and verified as one-hot
proposals. At temperature > 0 they are sampled from q, the drafter's distribution processed exactly
like the target's (repetition penalty over the same history, temperature, top-k, top-p, min-p), and
returned with q so verification accepts with min(1, p/q): acceptance is then sum(min(p, q)), close to 1
where q matches p, while a greedy draft of a high-entropy target is accepted only with probability
p(argmax q).
New weights from a trainer are swapped in here, between decode iterations, and invalidate the drafter
KV (it was computed by the old weights), which the staged features rebuild.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from rollout.speculation.drafters.base import DRAFTERS, Draft
from rollout.speculation.drafters.eagle3_fused import FusedDraftLayer
from rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model
from rollout.runtime.model import kernels
from rollout.runtime.model.fused import MAX_TOKENS as FUSED_MAX_TOKENS
from rollout.runtime.model.linear import fast_linear
from rollout.runtime.model.attention import attend_dense
from rollout.runtime.sampling import penalise, probs_from_logits, sample, sample_without_replacement, truncates
from rollout.speculation.feature_buffer import Dist, law_top_k
from rollout.runtime.sequence import Sequence


MAX_CONF = 0.4  # max-confidence stop rule: end the draft below this top-1 drafter probability
SVIP_BOUND = 0.3  # SVIP: end the draft when sqrt(0.15 * entropy) exceeds this


class Eagle3Drafter:
    name = "eagle3"
    extra_kv_layers = 1

    def __init__(self, target, model: Eagle3Model | None = None, draft_vocab_size: int = 4096, seed: int = 0,
                 tree_draws: str = "without_replacement"):
        if tree_draws not in ("without_replacement", "iid"):
            raise ValueError(f"tree_draws must be 'without_replacement' or 'iid', got {tree_draws!r}")
        # how a tree's root children are sampled at T > 0: without replacement (distinct tokens, which
        # recursive rejection sampling accepts more often) or i.i.d. (SpecInfer; kept to test both rules)
        self.tree_draws = tree_draws
        self.target = target
        p = next(target.parameters())
        if model is None:  # a local generator: building an engine must not reseed the user's global RNG
            model = Eagle3Model.initialised(Eagle3Config.for_target(target.cfg, draft_vocab_size),
                                            torch.Generator().manual_seed(seed))
        if model.cfg.vocab_size != target.cfg.vocab_size or model.cfg.hidden_size != target.cfg.hidden_size:
            from rollout.errors import TokenizerMismatchError

            raise TokenizerMismatchError(
                f"drafter (vocab {model.cfg.vocab_size}, hidden {model.cfg.hidden_size}) does not fit the target "
                f"(vocab {target.cfg.vocab_size}, hidden {target.cfg.hidden_size}); train or export a drafter "
                "for this target model")
        self.model = model.to(device=p.device, dtype=p.dtype).eval()
        self.fused_layer = FusedDraftLayer(self.model)  # chains' draft steps as one op (eagle3_fused.py)
        self.fused = None  # fused_layer while a proposal may use it (propose decides)
        if p.device.type == "cpu" and p.dtype == torch.bfloat16:
            kernels.available()  # load (once a machine: build) the few-row kernel its steps use (linear.fast_linear)
        self.aux_layers = tuple(model.cfg.aux_layer_ids)
        self.version = 0
        self.trainer = None  # a DrafterTrainer: takes finished samples (add), publishes weights (latest)
        # False once a trainer's own forward pass feeds the trainer (rollout/speculation/intake.py): the
        # engine then stages features for drafting only, and banks nothing (no sample counted twice)
        self.bank_samples = True
        self.target_cache = None  # the engine's PagedKVCache, given at each start()
        self.policy_version = 0
        self.valid: dict[int, int] = {}  # id(sequence) -> positions whose drafter KV is written
        self.committed: dict[int, int] = {}  # id(sequence) -> tokens its latest step committed (observe_verify)
        # seconds of the latest proposal's catch-up spent on a backlog: positions beyond what the latest step
        # committed (the drafter sat out some steps). Drafting on every step never pays them, so the selector
        # keeps them out of the drafter's per-level cost (Speculation.observe_step)
        self.backlog_seconds = 0.0
        self.params = None  # the call's SamplingParams: drafts are processed like the target
        self.history = None  # the call's TokenHistory when a repetition penalty is on
        self.generator = None
        self.stop_rule = "none"  # set per step from the arm: "none", "max_conf" or "entropy"
        self._rope_of, self._rope_tables = None, ()  # the target's RoPE tables in its dtype (_rope)
        self._vocab_of, self._vocab = None, None  # the draft vocabulary's target ids (_draft_vocab)

    # ---- engine hooks ---------------------------------------------------------------------------
    def side_buffers(self) -> dict:
        """What the drafter stages per cached position, in the KV pool's blocks: the target's features
        [3H]; with a trainer whose loss reads it, the target's top-k distribution of the next token too
        (ids, probs, the mass outside the top k, and whether the position has one: prompt positions don't),
        unless the samples come from elsewhere (bank_samples False)."""
        p = next(self.model.parameters())
        side = {"eagle3/features": ((3 * self.model.cfg.hidden_size,), p.dtype)}
        k = getattr(self.trainer, "topk", 0) if self.bank_samples else 0
        if k > 0:
            side.update({"eagle3/dist_ids": ((k,), torch.int32), "eagle3/dist_probs": ((k,), torch.float16),
                         "eagle3/dist_rest": ((), torch.float16), "eagle3/dist_has": ((), torch.bool)})
        return side

    @property
    def stages_dist(self) -> bool:
        """Whether this call's pool has the distribution buffers (side_buffers asked for them)."""
        return "eagle3/dist_ids" in self.target_cache.side

    def start(self, seqs: list[Sequence], cache, params=None, generator=None, history=None) -> None:
        self.target_cache, self.params, self.generator, self.history = cache, params, generator, history
        self.valid = {id(s): 0 for s in seqs}
        self.committed = {}

    def begin(self, groups) -> None:
        pass

    def set_policy_version(self, version: int) -> None:
        self.policy_version = version  # tags the training data of samples finished from now on

    def set_stop_rule(self, rule: str) -> None:
        self.stop_rule = rule

    def attach(self, trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict:
        """The weights drafting now (CPU copies, the engine's dtype) and their version. Per-call state
        (which positions have drafter KV, the call's sampling state) starts over at every start()."""
        return {"config": self.model.cfg.to_dict(), "version": self.version,
                "weights": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}}

    def state_misfit(self, state: dict) -> str | None:
        """Why `state` cannot load here (another network shape), or None."""
        here, saved = self.model.cfg.to_dict(), state["config"]
        diff = {k: (saved.get(k), v) for k, v in here.items() if saved.get(k) != v}
        return None if not diff else (
            f"eagle3 drafter shape (checkpoint, here): {diff} (build the engine with the target model and the "
            "SpecConfig draft_vocab_size / drafter_path of the run that saved it)")

    def load_state_dict(self, state: dict) -> None:
        problem = self.state_misfit(state)
        if problem:
            raise ValueError(f"the checkpoint's drafter state does not fit: {problem}")
        self.model.load_state_dict(state["weights"])
        self.version = int(state["version"])
        self.valid = {k: 0 for k in self.valid}  # any drafter KV came from the old weights

    def network(self) -> Eagle3Model:
        return self.model

    def observe_prefill(self, groups: list[list[Sequence]], feats: torch.Tensor) -> None:
        """feats [P, T, 3H]: the target's features of each group's prompt positions, staged once in the
        head sample's blocks, which its siblings then share (the engine shares them after this call)."""
        self._stage_prefix([g[0] for g in groups], [len(g[0].prompt_ids) for g in groups], feats)

    def observe_resume(self, seqs: list[Sequence], feats: torch.Tensor) -> None:
        """A preempted sequence was prefilled again: feats [B, T, 3H] of positions 0..cache_len-1. Their
        staged next-token distributions went with the blocks: those positions train on the sampled next
        token, as prompt positions do."""
        self._stage_prefix(seqs, [s.cache_len for s in seqs], feats)

    def _stage_prefix(self, seqs: list[Sequence], lens: list[int], feats: torch.Tensor) -> None:
        cache, dev = self.target_cache, feats.device
        pos = torch.arange(feats.shape[1], device=dev)[None, :]
        pos = torch.where(pos < torch.tensor(lens, device=dev)[:, None], pos, -1)  # padding -> trash block
        slots = cache.slots(torch.tensor([s.row for s in seqs], device=dev), pos)
        cache.write_side("eagle3/features", slots, feats)
        if self.stages_dist:  # a recycled block may still say "has" from its previous owner
            cache.write_side("eagle3/dist_has", slots, torch.zeros(slots.shape, dtype=torch.bool, device=dev))

    def observe_verify(self, seqs: list[Sequence], feats: torch.Tensor, path: torch.Tensor, accepted,
                       logits: torch.Tensor | None = None) -> None:
        """feats [B, N+1, 3H] at every verified node; the pending node and the accepted path are kept, at
        positions cache_len..cache_len+accepted of each row (sequence i sits in table row i)."""
        dev, cache = feats.device, self.target_cache
        for s, a in zip(seqs, accepted):
            self.committed[id(s)] = a + 1
        n = feats.shape[1]
        # positions cache_len .. cache_len + accepted (unkept nodes: the trash block), as slots from the host lists
        slots = torch.tensor([cache.host_slots(id(s), [s.cache_len + j if j <= a else -1 for j in range(n)])
                              for s, a in zip(seqs, accepted)], device=dev)
        if n == 1:  # a plain step: the pending node alone, kept in every row (half the ops)
            nodes, kept = torch.zeros(len(seqs), 1, dtype=torch.long, device=dev), feats
        else:
            nodes = torch.cat([torch.zeros(len(seqs), 1, dtype=torch.long, device=path.device), path.clamp(min=0)],
                              1).to(dev)
            kept = feats.gather(1, nodes[..., None].expand(-1, -1, feats.shape[-1]))
        cache.write_side("eagle3/features", slots, kept)
        if self.stages_dist and self.bank_samples and logits is not None:
            on = torch.arange(n, device=dev)[None, :] <= torch.tensor(accepted, device=dev)[:, None]
            self._stage_dist(slots, nodes, on, logits)

    def _stage_dist(self, slots: torch.Tensor, nodes: torch.Tensor, kept: torch.Tensor, logits: torch.Tensor) -> None:
        """The top-k of the target's processed distribution at each kept node (nodes [B, N+1], node 0 =
        the pending token; kept [B, N+1] bool), staged at the slot of that node's token: the law of the
        next token."""
        cache = self.target_cache
        rows, cols = kept.nonzero(as_tuple=True)  # only the kept nodes: ~2 per row
        slots = slots[rows, cols]  # [K]
        sel = logits[rows.to(logits.device), nodes[rows, cols].to(logits.device)]  # [K, V]
        ids, probs, rest = law_top_k(sel, self.params, cache.side["eagle3/dist_ids"].shape[-1])
        slots = slots.to(probs.device)
        cache.write_side("eagle3/dist_ids", slots, ids)
        cache.write_side("eagle3/dist_probs", slots, probs)
        cache.write_side("eagle3/dist_rest", slots, rest)
        cache.write_side("eagle3/dist_has", slots, torch.ones(slots.shape, dtype=torch.bool, device=slots.device))

    def evict(self, seq: Sequence) -> None:
        """Preempted: its KV blocks (this layer's and its staged features too) are gone; the engine's
        re-prefill stages the features again (observe_resume) and the next catch-up rebuilds the layer."""
        if id(seq) in self.valid:
            self.valid[id(seq)] = 0

    def finish(self, seq: Sequence) -> None:
        """Bank a finished sample's staged features (read now: the engine frees its blocks next), unless a
        trainer's own pass feeds the trainer (bank_samples False, rollout/speculation/intake.py)."""
        known = self.valid.pop(id(seq), None) is not None
        self.committed.pop(id(seq), None)
        if known and self.trainer is not None and self.bank_samples and seq.cache_len > 2:
            cache, n = self.target_cache, seq.cache_len
            slots = cache.owner_slots(id(seq), n)
            dist = Dist(*(cache.read_side(f"eagle3/dist_{f}", slots) for f in ("ids", "probs", "rest", "has"))) \
                if self.stages_dist else None
            temp = 1.0 if self.params is None or self.params.greedy else self.params.temperature
            self.trainer.add(cache.read_side("eagle3/features", slots), seq.all_ids()[:n + 1], self.policy_version,
                             dist, temp)

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        self.swap_latest()
        if max(max_tokens, default=0) == 0:
            return [Draft() for _ in seqs]
        self.fused = self.fused_layer.prepare() if self.fused_layer.usable else None
        t0 = time.perf_counter()
        h_last, ready, backlog = self._catch_up(seqs)
        self.backlog_seconds = (time.perf_counter() - t0) * backlog
        depth = max(max_tokens) if width == 1 else max(1, max(max_tokens) // width)
        branches, q, keep = self._draft(seqs, h_last, depth, width)  # ids, q or None, lengths [B]
        return [_to_draft(branches[i], None if q is None else q[i], min(cap, keep[i]), width) if ready[i]
                else Draft() for i, cap in enumerate(max_tokens)]

    def swap_latest(self) -> None:
        """Take the trainer's newest published weights, if newer than ours (between steps only)."""
        latest = self.trainer.latest() if self.trainer is not None else None
        if latest is not None and latest[0] > self.version:
            self.version, state = latest
            self.model.load_state_dict(state)
            self.valid = {k: 0 for k in self.valid}  # drafter KV came from the old weights

    def _catch_up(self, seqs: list[Sequence]):
        """Run the positions each sequence has not yet shown the drafter; returns its last output [B, H], which
        rows had any, and the backlog's share of the positions run (those beyond each row's latest commit)."""
        B = len(seqs)
        cache, L = self.target_cache, self.target.cfg.num_layers
        starts = [self.valid[id(s)] for s in seqs]
        counts = [s.cache_len - st for s, st in zip(seqs, starts)]
        backlog = sum(max(0, c - self.committed.get(id(s), 1)) for s, c in zip(seqs, counts)) / max(sum(counts), 1)
        C = max(max(counts), 1)
        top = self.target.rope_cos.shape[0] - 1
        # per row and query j: its token (the embedding of t + 1), the slot its key goes to (padding: the trash
        # block), its RoPE position and the last position it sees (its cached context and own prefix); made as
        # lists, one tensor: a catch-up is a few positions a row, and each small op costs more than its work
        grid = torch.tensor([[s.ids(st + 1, st + 1 + c) + [0] * (C - c),
                              cache.host_slots(id(s), [st + j if j < c else -1 for j in range(C)]),
                              [min(st + j, top) if j < c else 0 for j in range(C)], list(range(st, st + C))]
                             for s, st, c in zip(seqs, starts, counts)])
        dev = cache.table.device
        toks, slots, pos, sees = grid.to(dev).unbind(1)
        # whole blocks are read; start + C may pass the table for a row with a short catch-up beside a long
        # one (a preempted sequence catches up from 0), but its real keys end before its own start + count
        S = min(-(-(max(starts) + C) // cache.block_size) * cache.block_size, cache.length)
        rows = torch.arange(B, device=dev)
        feats = cache.read_side("eagle3/features", slots)  # [B, C, 3H]; padding reads the trash block, masked

        visible = (torch.arange(S, device=dev) <= sees[..., None])[:, None]  # [B, 1, C, S]
        # whole blocks: read in place (the kernel, the fused op), as target steps do
        blocks = cache.table[rows, : S // cache.block_size] if S % cache.block_size == 0 else None

        def attend(q, k, v):
            cache.write(L, slots, k.transpose(1, 2), v.transpose(1, 2))
            if blocks is not None and kernels.attention_usable(q, cache.k[L]):
                return kernels.paged_attention(q, cache.k[L], cache.v[L], blocks, visible, q.shape[-1] ** -0.5)
            keys, values = cache.gather(L, rows, S)
            return attend_dense(q, keys, values, visible)

        with torch.inference_mode():
            # one op, attending in place (eagle3_fused.py), up to the fused step's token count: a long catch-up
            # (a drafter unused for a while) is a product of many rows, which oneDNN does better than our kernel
            if self.fused is not None and blocks is not None and B * C <= FUSED_MAX_TOKENS:
                out = self.fused.step(fast_linear(self.model.fc, feats), self._embed(toks), *self._rope(pos),
                                      cache.k[L], cache.v[L], slots, blocks, visible)
            else:
                out = self.model(feats, self._embed(toks), *self._rope(pos), attend)
        for s in seqs:
            self.valid[id(s)] = s.cache_len
        ready = [c > 0 for c in counts]
        if min(counts) == C:  # every row ran C positions (one index op fewer: most steps)
            return out[:, C - 1], ready, backlog
        return out[rows, torch.tensor([max(c - 1, 0) for c in counts], device=dev)], ready, backlog

    def _confident(self, logits: torch.Tensor) -> torch.Tensor:
        """[R] bool: may the chain go on, by the arm's stop rule (docs/drafters.md#stop-rules)?"""
        probs = torch.softmax(logits, -1)
        if self.stop_rule == "max_conf":
            return probs.max(-1).values >= MAX_CONF
        entropy = -(probs * torch.log(probs.clamp(min=1e-12))).sum(-1)
        return torch.sqrt(0.15 * entropy) <= SVIP_BOUND

    def _pick(self, h: torch.Tensor, k: int, ids: torch.Tensor, seen: torch.Tensor | None = None):
        """Next tokens from drafter outputs h [R, H]: k per row -> (target ids [R, k], q [R, k, Vd] or None,
        confident [R], None without a stop rule); ids [Vd]: the draft vocabulary's target ids
        (`Eagle3Model.draft_vocab`). Greedy: the top k. Sampling
        from q, the processed distribution over the draft vocabulary (zero elsewhere, so sampling there loses
        nothing; `_draft` spreads q over the target's vocabulary once per proposal, for verification): k > 1
        draws without replacement (or i.i.d. with tree_draws="iid"); q[:, j] is the distribution draw j came
        from given the earlier ones, which is what verification needs. seen [R, V]: the history the drafted
        token follows (repetition penalty; None = off), the same as the target's node there, so q stays close
        to p."""
        logits = self.model.logits(h) if self.fused is None or len(h) > FUSED_MAX_TOKENS else self.fused.logits(h)
        ok = None if self.stop_rule == "none" else self._confident(logits)
        seen = None if seen is None else seen[:, ids]
        if self.params is None or self.params.greedy:
            return ids[penalise(logits, seen, self.params).topk(k, -1).indices], None, ok
        q = probs_from_logits(logits, self.params, seen)  # [R, Vd]
        if k > 1 and self.tree_draws == "without_replacement":
            tok, qs = sample_without_replacement(q, k, self.generator)
            return ids[tok], qs, ok
        if k > 1:
            q = q.repeat_interleave(k, 0)  # [R*k, Vd]
        tok = sample(q, self.generator)
        return ids[tok].view(len(h), k), q.view(len(h), k, -1), ok

    def _draft(self, seqs, h: torch.Tensor, depth: int, width: int):
        """Chains, `width` of them branching at the root -> (target ids [B, width, depth],
        q [B, width, depth, V] on the CPU or None for greedy drafts, nodes to keep per row [B] by the
        stop rule: a chain ends before the first token drawn from an unsure distribution)."""
        B, dev = len(seqs), h.device
        with torch.inference_mode():
            # each branch's history: its sequence's tokens (by table row: a lossy proposer may pass a subset of
            # the live rows), then the branch's own drafts
            seen = None if self.history is None else self.history.rows(torch.tensor([s.row for s in seqs], device=dev))
            vocab = self._draft_vocab()
            rows = torch.arange(B, device=dev) if width == 1 else torch.arange(B, device=dev).repeat_interleave(width)
            lens = [s.cache_len for s in seqs for _ in range(width)]
            # fused steps write their keys (eagle3_fused.py); many rows are products oneDNN does better
            if self.fused is not None and width == 1 and B <= FUSED_MAX_TOKENS:
                inputs = self._chain_inputs([id(s) for s in seqs], rows, lens, depth)
                if self._chain_op_serves(seen, len(vocab)):
                    ids, q, kept = self._chain_op(h, depth, vocab, inputs)
                else:
                    ids, q, kept = self._draw_steps(h, depth, 1, vocab, seen, self._fused_steps(inputs))
            else:
                cache, L = self.target_cache, self.target.cfg.num_layers
                attend = _DraftAttention(*cache.gather(L, rows, max(lens)), torch.tensor(lens, device=dev))
                ids, q, kept = self._draw_steps(h, depth, width, vocab, seen, self._eager_steps(attend, lens, depth))
        ids = ids.view(B, width, depth).cpu()
        # trees: every branch to the shortest
        keep = [depth * width] * B if kept is None else \
            (kept if width == 1 else kept.view(B, width).amin(-1) * width).tolist()
        V = self.model.cfg.vocab_size
        if q is None or q.shape[-1] == V:  # none (greedy), or already over the target's vocabulary (the chain op)
            return ids, None if q is None else q.view(B, width, depth, V), keep
        q = q.view(B, width, depth, -1).float()  # over the draft vocabulary
        return ids, q.new_zeros(B, width, depth, V).index_copy_(3, vocab.to(q.device), q), keep

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

    def _chain_op(self, h: torch.Tensor, depth: int, vocab: torch.Tensor, inputs: tuple):
        """Chains (one per row of h [R, H]) drawn in one op (FusedDraftLayer.chain, kernels/draft_chain.cpp): the
        processed distribution is softmax(logits / T) there (no penalty, no truncation; greedy: the top token).
        -> (target ids [R, depth], q [R, depth, V] over the target's vocabulary or None when greedy, nodes to
        keep [R]: the leading draws that were finite and, with a stop rule, drawn from a sure distribution)."""
        greedy = self.params is None or self.params.greedy
        # the uniforms of every draw at once, from the call's generator, as sample() takes them
        r = torch.zeros(depth, len(h)) if greedy else torch.rand(depth, len(h), generator=self.generator)
        ids, q, logits, finite = self.fused.chain(h, self.target.model.embed_tokens.weight, *inputs, vocab, r,
                                                  0.0 if greedy else float(self.params.temperature))
        ok = finite if self.stop_rule == "none" else finite & self._confident(logits)
        return ids, None if greedy else q, ok.long().cumprod(1).sum(1)

    def _draw_steps(self, h: torch.Tensor, depth: int, width: int, vocab: torch.Tensor, seen, step_fn):
        """Chains drawn one token at a time, `width` of them below each row of h [B, H], each draft step through
        step_fn(h, embeds, j) -> (target ids [B * width, depth], q [B * width, depth, Vd] or None when greedy,
        nodes to keep [B * width] by the stop rule or None without one)."""
        first, q_first, ok = self._pick(h, width, vocab, seen)  # [B, w]
        # a stop rule's bookkeeping only where one is on: without, every chain keeps its depth
        alive = None if ok is None else ok.repeat_interleave(width)
        kept = None if ok is None else alive.long()
        tok = first.reshape(-1)  # [B*w]
        if seen is not None:
            seen = seen.repeat_interleave(width, 0).scatter(1, tok[:, None], True)
        qs = None if q_first is None else [q_first.reshape(len(tok), -1)]
        out = [tok]
        h = h.repeat_interleave(width, 0)
        for step in range(1, depth):
            h = step_fn(h[:, None], self._embed(tok[:, None]), step - 1)[:, 0]
            nxt, q, ok = self._pick(h, 1, vocab, seen)
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

    def _step_rope(self, lens: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of draft steps 1..depth-1 (step j stands at position lens + j - 1), gathered for all of them at
        once: cos and sin [depth - 1, R, 1, 1, D], contiguous, so that step j's [R, 1, 1, D] is cos[j - 1]."""
        top = self.target.rope_cos.shape[0] - 1
        pos = torch.tensor([[min(n + j, top) for n in lens] for j in range(depth - 1)], dtype=torch.long)
        cos, sin = self._rope(pos)
        return cos[:, :, None], sin[:, :, None]

    def _eager_steps(self, attend, lens: list[int], depth: int):
        """Draft steps through the network, attending with `attend` (_DraftAttention): step(h, embeds, j), j =
        0 .. depth-2 for draft steps 1 .. depth-1."""
        cos, sin = self._step_rope(lens, depth)
        return lambda h, embeds, j: self.model(h, embeds, cos[j], sin[j], attend)

    def _chain_inputs(self, owners: list[int], rows: torch.Tensor, lens: list[int], depth: int) -> tuple:
        """What the fused draft steps of chains differ in, made for all of them at once (not ~15 small ops a step
        again: with the changes beside it, a 4-token proposal 2.55 -> 2.31 ms, session 18). Draft step j + 1 writes
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
        write, slots = torch.tensor(grid, dtype=torch.long).view(2, S, R).to(dev)  # each [S, R]
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
        """RoPE at positions pos [...] -> cos, sin [..., 1, D] in the target's dtype, from its tables converted once
        (while the target keeps the same tables)."""
        if self._rope_of is not self.target.rope_cos:
            dtype = self.target.lm_head.weight.dtype
            self._rope_of = self.target.rope_cos
            self._rope_tables = (self.target.rope_cos.to(dtype), self.target.rope_sin.to(dtype))
        cos, sin = self._rope_tables
        pos = pos.to(cos.device)
        return cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)


class _DraftAttention:
    """Attention of the draft steps: each branch's queries over its row's cached context (keys [R, KV, S, D]
    gathered once per proposal; positions at or past the row's length `lens` [R] hidden) and over the
    branch's own earlier draft keys, which are never cached. The context is scored on its own, in float32
    converted once, so no step copies it again; on the CPU a step's attention took 104 us against 194 us
    concatenating context and draft keys into one bf16 attention (and 248 us through SDPA), 300 positions."""

    def __init__(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor, lens: torch.Tensor):
        S = ctx_k.shape[2]
        self.k, self.v = ctx_k.float(), ctx_v.float()
        hidden = torch.arange(S, device=lens.device)[None, :] >= lens[:, None]
        self.bias = torch.zeros(hidden.shape, device=lens.device).masked_fill(hidden, float("-inf"))[:, None, None]
        self.local_k: list[torch.Tensor] = []
        self.local_v: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [R, H, T, D], this step's k, v [R, KV, T, D] -> [R, H, T, D] in q's dtype (T = 1 when drafting: a
        step's own key is its last; longer T would need a causal mask among them)."""
        self.local_k.append(k.float())
        self.local_v.append(v.float())
        R, H, T, D = q.shape
        KV, S = self.k.shape[1], self.k.shape[2]
        qf = q.float().reshape(R, KV, H // KV * T, D) * D ** -0.5
        lk, lv = torch.cat(self.local_k, 2), torch.cat(self.local_v, 2)
        scores = torch.cat([qf @ self.k.transpose(-1, -2) + self.bias, qf @ lk.transpose(-1, -2)], -1)
        p = torch.softmax(scores, -1)
        out = p[..., :S] @ self.v + p[..., S:] @ lv
        return out.reshape(R, H, T, D).to(q.dtype)


def _to_draft(branches: torch.Tensor, q, cap: int, width: int) -> Draft:
    """[w, depth] target ids (+ q [w, depth, V]) -> a Draft of at most `cap` nodes: w chains below the root."""
    if cap <= 0:
        return Draft()
    if width == 1:
        return Draft.chain(branches[0, :cap].tolist(), None if q is None else q[0, :cap])
    w = min(width, cap)
    depth = cap // w
    tokens, parents = [], []
    for b in range(w):
        for d in range(depth):
            parents.append(-1 if d == 0 else len(tokens) - 1)
            tokens.append(int(branches[b, d]))
    return Draft(tokens, parents, None if q is None else q[:w, :depth].reshape(w * depth, -1))


@DRAFTERS.register("eagle3", learned=True, auto=True)
def _build(target=None, spec=None, **overrides) -> Eagle3Drafter:
    """A trained drafter from spec.drafter_path, or a cold one (only online training makes a cold
    drafter useful; the selectors keep it off until its measured acceptance pays)."""
    if target is None:
        raise ValueError("the eagle3 drafter reads the target's hidden states: build it with target=<the model>")
    if spec is not None and spec.drafter_path:
        from rollout.speculation.drafters.eagle3_io import load_eagle3

        return Eagle3Drafter(target, load_eagle3(spec.drafter_path), **overrides)
    vocab = spec.draft_vocab_size if spec is not None else 4096
    return Eagle3Drafter(target, draft_vocab_size=vocab, **overrides)
