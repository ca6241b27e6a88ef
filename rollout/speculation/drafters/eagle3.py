"""The learned EAGLE-3 drafter inside the engine: catch up on the target's features, then draft.

Per sequence the drafter keeps one layer of KV in the engine's paged cache (an extra layer of the
same blocks, so sharing and preemption cover it) and the target features of every cached
position, staged in side buffers of the same blocks (kv_cache.py): they cost memory only for the tokens
held, a prompt's are shared by its samples, and they go with the blocks when a sequence finishes or is
preempted (the engine's re-prefill of a preempted sequence stages them again). Each step:
1. catch-up (eagle3_catch_up.py): run positions valid..cache_len-1 (features of token t, embedding of token t+1),
   writing the drafter's KV; the last output predicts the token after the pending one. After a verify of its own
   drafts it runs before the host reads the step (`observe_verify`);
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

from rlspec.rollout.speculation.drafters.base import DRAFTERS, Ahead, Draft, DraftTensors
from rlspec.rollout.speculation.drafters.eagle3_catch_up import CatchUp
from rlspec.rollout.speculation.drafters.eagle3_draws import ChainDraws
from rlspec.rollout.speculation.drafters.eagle3_fused import FusedDraftLayer
from rlspec.rollout.speculation.drafters.eagle3_graphs import GRAPH_MODES, DraftLevelGraphs
from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model
from rlspec.rollout.runtime.blocks import TRASH
from rlspec.rollout.runtime.model import kernels
from rlspec.rollout.speculation.training.feature_buffer import Dist, law_top_k
from rlspec.rollout.runtime.sequence import Sequence


class Eagle3Drafter(ChainDraws, CatchUp):
    name = "eagle3"
    extra_kv_layers = 1

    def __init__(self, target, model: Eagle3Model | None = None, draft_vocab_size: int = 4096, seed: int = 0,
                 tree_draws: str = "without_replacement", graph_mode: str = "auto"):
        if tree_draws not in ("without_replacement", "iid"):
            raise ValueError(f"tree_draws must be 'without_replacement' or 'iid', got {tree_draws!r}")
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        # draft levels from graphs (eagle3_graphs.py): "auto" on a CUDA device, "emulate" replays by calling
        self.graph_mode, self._graphs = graph_mode, None
        # how a tree's root children are sampled at T > 0: without replacement (distinct tokens, which
        # recursive rejection sampling accepts more often) or i.i.d. (SpecInfer; kept to test both rules)
        self.tree_draws = tree_draws
        self.target = target
        p = next(target.parameters())
        if model is None:  # a local generator: building an engine must not reseed the user's global RNG
            model = Eagle3Model.initialised(Eagle3Config.for_target(target.cfg, draft_vocab_size),
                                            torch.Generator().manual_seed(seed))
        if model.cfg.vocab_size != target.cfg.vocab_size or model.cfg.hidden_size != target.cfg.hidden_size:
            from rlspec.rollout.errors import TokenizerMismatchError

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
        # False once a trainer's own forward pass feeds the trainer (rollout/speculation/training/intake.py): the
        # engine then stages features for drafting only, and banks nothing (no sample counted twice)
        self.bank_samples = True
        self.target_cache = None  # the engine's PagedKVCache, given at each start()
        self.policy_version = 0
        self.valid: dict[int, int] = {}  # id(sequence) -> positions whose drafter KV is written
        self.committed: dict[int, int] = {}  # id(sequence) -> tokens its latest step committed (observe_commit)
        self._verified = (None, None)  # the latest observe_verify's slots [B, N+1] and kept nodes, for observe_commit
        self._consts: dict = {}  # small index tensors made once (CatchUp._columns)
        self._proposed = None  # the rows of a proposal whose verify has not been staged yet (observe_verify)
        self._early = None  # the early catch-up's ({id(sequence): row}, last outputs [B, H]) (eagle3_catch_up.py)
        self.early_span = None  # its device seconds, for the selector's drafting cost (Speculation.observe_step)
        # the early catch-up where the device runs it while the host works; on a CPU the host is the device, and it
        # would only cost the catch-up of every verified node where a proposal's covers the kept ones
        self.early = p.device.type == "cuda"
        # seconds of the latest proposal's catch-up spent on a backlog: positions beyond what the latest step
        # committed (the drafter sat out some steps). Drafting on every step never pays them, so the selector
        # keeps them out of the drafter's per-level cost (Speculation.observe_step)
        self.backlog_seconds = 0.0
        self.params = None  # the call's SamplingParams: drafts are processed like the target
        self.history = None  # the call's TokenHistory when a repetition penalty is on
        self.generator = None
        self.draws = None  # the call's KeyedDraws when it has per-sample keys (start)
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

    def start(self, seqs: list[Sequence], cache, params=None, generator=None, history=None, draws=None) -> None:
        self.target_cache, self.params, self.generator, self.history = cache, params, generator, history
        self.draws = draws  # the call's KeyedDraws, or None: where sampled drafts' uniforms come from (_uniforms)
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
        pos = torch.where(pos < cache.ints(lens)[:, None], pos, -1)  # padding -> trash block
        slots = cache.slots(cache.ints([s.row for s in seqs]), pos)
        cache.write_side("eagle3/features", slots, feats)
        if self.stages_dist:  # a recycled block may still say "has" from its previous owner
            cache.write_side("eagle3/dist_has", slots, torch.zeros(slots.shape, dtype=torch.bool, device=dev))

    def observe_verify(self, seqs: list[Sequence], feats: torch.Tensor, path: torch.Tensor | None,
                       accepted: torch.Tensor | None, ahead: int = 0, tokens: torch.Tensor | None = None,
                       start: torch.Tensor | None = None, top: int = 0, logits: torch.Tensor | None = None) -> None:
        """feats [B, N+1, 3H] at every verified node; the pending node and the accepted path are kept, at
        positions cache_len..cache_len+accepted of each row, `ahead` further on for a plain step launched before the
        host committed the one in front of it (sequence i sits in table row i). path: a tree's accepted nodes [B, N]
        (None: a chain's, node j at position j, or a plain step). accepted: the verifier's counts [B]
        on the device (None: a plain step), so the features are staged before the host reads the step, while the
        device still runs it; what needs the counts on the host waits for `observe_commit`. tokens [B, N+1]: the
        step's emitted tokens; with them, a verify of this drafter's own proposal runs the next catch-up now
        (eagle3_catch_up.py; `early`: on CUDA). A chain step gives start [B], its rows' positions on the device (a
        step launched ahead: the host does not know them; top bounds their largest), and its logits, whose
        training law is staged now (`observe_commit` then stages none)."""
        cache, n = self.target_cache, feats.shape[1]
        # an early run serves the next proposal only, and its seconds this step's
        proposed, self._proposed, self._early, self.early_span = self._proposed, None, None, None
        if start is None:  # positions cache_len .. cache_len + N as slots from the host lists
            starts = [s.cache_len + ahead for s in seqs]
            slots = cache.ints([cache.host_slots(id(s), range(st, st + n)) for s, st in zip(seqs, starts)])
        else:  # from the table on the device (a row's blocks for its kept nodes are in it: the step wrote them)
            starts = start
            slots = cache.slots(self._columns(len(seqs), start.device), start[:, None] + self._columns(n, start.device))
        # nodes past a row's accepted path go to the trash block (their blocks, draft room, are the row's until the
        # commit trims them)
        if n > 1:
            slots.masked_fill_(self._columns(n, slots.device)[None, :] > accepted[:, None].to(slots.device),
                               TRASH * cache.block_size)
        if path is None:  # a plain step's pending node, or a chain's node j at position j: kept as they are
            nodes, kept = None, feats
        else:  # a tree's path: node path[j - 1] goes to position j
            nodes = torch.cat([torch.zeros(len(seqs), 1, dtype=torch.long, device=path.device), path.clamp(min=0)],
                              1).to(feats.device)
            kept = feats.gather(1, nodes[..., None].expand(-1, -1, feats.shape[-1]))
        cache.write_side("eagle3/features", slots, kept)
        self._verified = (slots, nodes) if logits is None else (None, None)
        if logits is not None and self.stages_dist and self.bank_samples:  # every node: unkept ones to the trash
            self._stage_dist(slots, nodes, None, logits[:len(seqs), :n])
        if self.early and tokens is not None and accepted is not None and proposed == [id(s) for s in seqs]:
            self._catch_up_early(seqs, starts, slots, tokens, accepted, top)

    def observe_commit(self, seqs: list[Sequence], accepted: list[int], logits: torch.Tensor | None = None) -> None:
        """The host has the step `observe_verify` staged: accepted drafts per row. Each row's committed count (a
        catch-up's backlog is what lies beyond it), and for the rows an early catch-up ran, the positions it wrote
        (the row's length after this commit); with a trainer that learns from the target's law, that law at the
        kept nodes (logits: the step's, not yet overwritten by the next replay)."""
        ran = self._early[0] if self._early is not None else {}
        for s, a in zip(seqs, accepted):
            self.committed[id(s)] = a + 1
            if id(s) in ran:
                self.valid[id(s)] = s.cache_len + a + 1
        (slots, nodes), self._verified = self._verified, (None, None)
        if slots is not None and self.stages_dist and self.bank_samples and logits is not None:
            self._stage_dist(slots, nodes, accepted, logits)

    def _stage_dist(self, slots: torch.Tensor, nodes: torch.Tensor | None, accepted: list[int] | None,
                    logits: torch.Tensor) -> None:
        """The top-k of the target's processed distribution at each kept node (nodes [B, N+1], node 0 = the pending
        token; None: node j at column j, a chain's or a plain step's; row i keeps its first accepted[i] + 1), staged
        at the slot of that node's token: the law of the next token. accepted None: the counts are the device's,
        every node is staged, and the slots of those not kept are the trash block's already."""
        cache = self.target_cache
        if accepted is None:
            B, n = slots.shape
            rows, cols = self._columns(B, slots.device).repeat_interleave(n), self._columns(n, slots.device).repeat(B)
        else:  # only the kept nodes (~2 a row), listed on the host from the counts it has: no read of the device
            rows, cols = cache.ints([[i for i, a in enumerate(accepted) for _ in range(a + 1)],
                                     [j for a in accepted for j in range(a + 1)]])
        slots = slots[rows, cols]  # [K]
        sel = logits[rows.to(logits.device), (cols if nodes is None else nodes[rows, cols]).to(logits.device)]
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

    def abandon(self, seq: Sequence) -> None:
        """A partial round stopped seq unfinished: nothing is banked (its features are of an unfinished text)."""
        self.valid.pop(id(seq), None)
        self.committed.pop(id(seq), None)

    def finish(self, seq: Sequence) -> None:
        """Bank a finished sample's staged features (read now: the engine frees its blocks next), unless a
        trainer's own pass feeds the trainer (bank_samples False, rollout/speculation/training/intake.py)."""
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
        return self.propose_tensors(seqs, max_tokens, width).to_drafts()

    def propose_tensors(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> DraftTensors:
        """propose()'s drafts left on the device, for the decode step to verify where they are. Under a stop rule
        the rows' kept lengths come to the host (the funnel's one transfer of the proposal): the verify's width is
        the longest kept draft, and a batch whose drafts all stop early verifies fewer tokens."""
        self.swap_latest()
        if max(max_tokens, default=0) == 0:
            return DraftTensors(torch.zeros(len(seqs), 1, 0, dtype=torch.long), None, [0] * len(seqs))
        self.fused = self.fused_layer.prepare() if self.fused_layer.usable else None
        t0 = time.perf_counter()
        h_last, ready, backlog = self._catch_up(seqs)
        self.backlog_seconds = (time.perf_counter() - t0) * backlog
        depth = max(max_tokens) if width == 1 else max(1, max(max_tokens) // width)
        ids, q, kept = self._draft(seqs, h_last, depth, width)
        caps = [cap if ok else 0 for cap, ok in zip(max_tokens, ready)]
        if kept is not None:
            caps = [min(cap, int(k)) for cap, (k,) in zip(caps, self.target_cache.host_rows(kept[:, None]))]
        self._proposed = [id(s) for s in seqs]  # its verify may run the next catch-up early (observe_verify)
        return DraftTensors(ids, q, caps)

    def ahead_ready(self, seqs: list[Sequence]) -> bool:
        """Whether chains of these rows may be drafted before the host reads the step in front (`propose_ahead`):
        the catch-up runs early, the levels replay from graphs (they take the rows' lengths from the device), and
        no newer weights wait (they are taken between steps the host has read)."""
        return self.early and self.level_graphs() is not None and not self._weights_waiting()

    def propose_ahead(self, seqs: list[Sequence], depth: int, ahead: Ahead) -> DraftTensors | None:
        """A chain of `depth` a row for the step after the one in flight (rollout/chains_ahead.py): its levels draw
        from the early catch-up's outputs, each row at its length after that step (ahead.start, on the device).
        None where that catch-up did not run over exactly these rows (the step in flight drafted nothing, or
        another drafter's drafts). Under a stop rule each row's kept count stays on the device (`DraftTensors.kept`).
        The drafts are `propose_tensors`' after the host's commit: greedy, or sampled from uniforms keyed by each
        row's key and position (a sampled call looks ahead only with keys; `ChainDraws._uniforms`)."""
        early = self._early
        if early is None or len(early[0]) != len(seqs) or any(early[0].get(id(s)) != i for i, s in enumerate(seqs)):
            return None
        self.fused, self.backlog_seconds = None, 0.0
        ids, q, kept = self._draft(seqs, early[1], depth, 1, ahead)
        self._proposed = [id(s) for s in seqs]
        return DraftTensors(ids, q, [depth] * len(seqs), kept)

    def appended(self, seqs: list[Sequence]) -> None:
        pass  # what it keeps per row moves on at observe_commit

    def _weights_waiting(self) -> bool:
        latest = self.trainer.latest() if self.trainer is not None else None
        return latest is not None and latest[0] > self.version

    def level_graphs(self) -> DraftLevelGraphs | None:
        """The draft levels' graphs (made on first use), or None where levels run eagerly."""
        if self._graphs is None and self.graph_mode != "off":
            device = next(self.model.parameters()).device
            if self.graph_mode == "emulate":
                self._graphs = DraftLevelGraphs(self.model, device, "emulate")
            elif device.type == "cuda":
                self._graphs = DraftLevelGraphs(self.model, device, "cuda")
        return self._graphs

    def swap_latest(self) -> None:
        """Take the trainer's newest published weights, if newer than ours (between steps only)."""
        latest = self.trainer.latest() if self.trainer is not None else None
        if latest is not None and latest[0] > self.version:
            self.version, state = latest
            self.model.load_state_dict(state)
            self.valid = {k: 0 for k in self.valid}  # drafter KV came from the old weights


@DRAFTERS.register("eagle3", learned=True, auto=True)
def _build(target=None, spec=None, **overrides) -> Eagle3Drafter:
    """A trained drafter from spec.drafter_path, or a cold one (only online training makes a cold
    drafter useful; the selectors keep it off until its measured acceptance pays)."""
    if target is None:
        raise ValueError("the eagle3 drafter reads the target's hidden states: build it with target=<the model>")
    if spec is not None and spec.drafter_path:
        from rlspec.rollout.speculation.drafters.eagle3_io import load_eagle3

        return Eagle3Drafter(target, load_eagle3(spec.drafter_path), **overrides)
    vocab = spec.draft_vocab_size if spec is not None else 4096
    return Eagle3Drafter(target, draft_vocab_size=vocab, **overrides)
