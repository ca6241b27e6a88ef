"""RolloutEngine: construction, the public surface and the call loop admit -> make room -> decode step -> retire.

The decode step itself (rollout/decode.py) is the same in every mode:

    schedule -> propose -> one target forward -> verify -> one host transfer -> commit

the proposer and the verifier are strategies the config picks (rollout/speculation/strategies.py: lossless
speculation, or a lossy mode's pair from rollout/lossy/). Bookkeeping (sequences, rows, stop rules) is plain Python;
tensors live in the runner, sampling and verification, and every copy between them and the host goes through the
runner's funnel (rollout/runtime/transfers.py). Without a drafter every step is plain autoregressive decoding: a
verify of zero drafts, so there is one code path and speculation can only change speed, never the law sampled.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch

import rlspec.rollout.metrics as M
from rlspec.rollout.decode import Call, DecodeSteps, lean_plain
from rlspec.rollout.eos import resolve_eos
from rlspec.rollout.limits import check_request
from rlspec.rollout.metrics import RolloutMetrics
from rlspec.rollout.nonfinite import bad_rows, finite_flags
from rlspec.rollout.partial import round_over, round_sequences
from rlspec.rollout.registry import STRATEGIES
from rlspec.rollout.runtime.draws import KeyedDraws, bound, call_draws
from rlspec.rollout.runtime.history import TokenHistory
from rlspec.rollout.runtime.kv_budget import DEFAULT_BLOCK_SIZE, KVBudget
from rlspec.rollout.runtime.kv_ledger import KVLedger
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.runner import KEEP_KV_FRACTION, ModelRunner
from rlspec.rollout.runtime.sampling import greedy_tokens, logprobs_of, probs_from_logits, sample
from rlspec.rollout.runtime.scheduler import Scheduler
from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.speculation.drafters.base import Drafter
from rlspec.rollout.speculation.speculation import Speculation, build_speculation
from rlspec.rollout.speculation.strategies import Proposer, Verifier
from rlspec.rollout.types import PartialRound, RolloutResult, SamplingParams, SpecConfig


class RolloutEngine(DecodeSteps):
    supports_partial_rollouts = True  # generate(..., partial=PartialRound): stop a round and carry samples on
    supports_sample_keys = True  # generate(..., sample_keys=[...]): per-sample random keys (runtime/draws.py)

    def __init__(self, model, tokenizer, spec: SpecConfig | None = None, max_model_len: int = 2048,
                 max_num_seqs: int = 64, eos_token_ids: Iterable[int] | None = None, drafter: Drafter | None = None,
                 graph_mode: str = "auto", kv_memory_gb: float | None = None, kv_memory_fraction: float | None = None,
                 kv_block_size: int = DEFAULT_BLOCK_SIZE, free_kv_between_rollouts: bool | None = None,
                 compile_mode: str = "auto", keep_kv_fraction: float = KEEP_KV_FRACTION):
        """Prefer from_pretrained / from_hf_model. `drafter` plugs in a custom Drafter instance.

        KV memory (docs/runtime.md#paged-kv-cache): the pool holds kv_memory_gb GiB, or kv_memory_fraction
        of the free device memory, or by default what max_num_seqs sequences of the call's longest length
        could use (capped at 90% of free memory); sequences are admitted while blocks last and the
        youngest are preempted when they run out. free_kv_between_rollouts: hand the pool back at the
        end of every generate() so a policy update has the memory (None: on for CUDA, off on CPU), except a
        pool with CUDA graphs over it that takes at most keep_kv_fraction of the device (runtime/runner.py).
        compile_mode: "on" runs steps through the compiled decoder layer (runtime/compiled.py; inside the CUDA
        graphs on a GPU), "off" eagerly, "auto" (default) compiles where it was measured to pay: a CPU in bf16."""
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec or SpecConfig()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        p = next(model.parameters())
        self.eos_token_ids = set(eos_token_ids or resolve_eos(None, tokenizer))
        self.policy_version = 0
        self._metrics = RolloutMetrics()
        self.speculation: Speculation = build_speculation(self.spec, model, drafter)
        self.proposer, self.verifier = build_strategies(self.spec, model, tokenizer, self.speculation)
        # CUDA graphs (rollout/graphs.py) on GPUs, eager elsewhere; sized for the largest verify
        if model.cfg.moe_layers:  # routed experts loop over the experts hit: not capturable (model/moe.py)
            graph_mode = "off"
        self.runner = ModelRunner(model, p.device, p.dtype, graph_mode, max_graph_t=self._draft_slack(),
                                  budget=KVBudget(kv_memory_gb, kv_memory_fraction, kv_block_size),
                                  compile_mode=compile_mode, keep_kv_fraction=keep_kv_fraction)
        trainer_bytes = getattr(self.speculation.trainer, "memory_bytes", None)
        if trainer_bytes is not None:  # an online drafter trainer on this device: the KV pool leaves it room
            self.runner.reserves["drafter"] = trainer_bytes()
        self.free_kv_between_rollouts = p.device.type == "cuda" if free_kv_between_rollouts is None \
            else free_kv_between_rollouts
        self._pool: tuple[float, float] | None = None  # (MiB, blocks) of the last call's KV pool
        # plain steps launch their successor before the host reads them (rollout/decode.py) where the device runs
        # steps while the host works; on a CPU the host is the device and a step looked ahead only costs it
        self.look_ahead = p.device.type == "cuda"
        # and go on past rows that ended while retiring them would admit nothing (rollout/chains_ahead.py `carry_ended`)
        self.carry_ended = True
        self._sync: loader.WriteLedger | None = None  # an open load_weights(..., complete=False) sync

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str, spec: SpecConfig | None = None, device="cpu", dtype="bfloat16",
                        max_model_len: int = 2048, max_num_seqs: int = 64, graph_mode: str = "auto",
                        **kv) -> "RolloutEngine":
        """model: a local HF directory, a hub id, or the embedded alias "smollm2-135m-instruct".
        graph_mode: CUDA graphs ("auto", "off", "lazy", "eager_start"; rollout/runtime/graphs.py).
        kv: kv_memory_gb, kv_memory_fraction, kv_block_size, free_kv_between_rollouts (see __init__)."""
        from transformers import AutoTokenizer

        from rlspec.rollout.runtime.model.fetch import fetch_model

        path = fetch_model(model)
        runtime = loader.load_model(path, dtype=dtype, device=device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(runtime, tokenizer, spec, max_model_len, max_num_seqs, resolve_eos(path, tokenizer),
                   graph_mode=graph_mode, **kv)

    @classmethod
    def from_hf_model(cls, hf_model, tokenizer, spec: SpecConfig | None = None, dtype=None, device=None,
                      max_model_len: int = 2048, max_num_seqs: int = 64, graph_mode: str = "auto",
                      head_dtype=None, **kv) -> "RolloutEngine":
        """Build from an in-memory transformers model (the trainer's policy); weights are copied.
        dtype None: the decoder layers' dtype (trainers pass their compute dtype, trainers/sampling_dtype.py);
        head_dtype: the LM head's, when it differs (float32 for TRL's cast_lm_head_to_fp32).
        graph_mode, kv: as in from_pretrained."""
        runtime = loader.from_hf_model(hf_model, loader.resolve_dtype(dtype) if dtype else None, device, head_dtype)
        return cls(runtime, tokenizer, spec, max_model_len, max_num_seqs, resolve_eos(hf_model, tokenizer),
                   graph_mode=graph_mode, **kv)

    # ---- public surface ---------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], complete: bool = True) -> None:
        """Policy sync from the trainer (HF parameter names); bumps policy_version when the sync is complete.

        Every runtime tensor must be written exactly once per sync (rollout.errors.WeightSyncError otherwise).
        A sync sent in several calls (buckets) passes complete=False to all but the last; the last call (which
        may carry no tensors) checks the whole sync."""
        self._sync = self._sync or loader.WriteLedger(self.model)
        try:
            loader.load_named_tensors(self.model, named_tensors, self._sync)
            if not complete:
                return
            self._sync.finish()
        except Exception:
            self._sync = None  # a failed sync is over: the next one starts afresh
            raise
        self._sync = None
        self.policy_version += 1
        self.speculation.set_policy_version(self.policy_version)

    def stats(self) -> dict[str, float]:
        """Slash-named metrics accumulated since the previous call."""
        out = self._metrics.as_dict()
        out[M.POLICY_VERSION] = float(self.policy_version)
        if self._pool is not None:  # the pool of the last call, also once released
            out[M.KV_CACHE_MB], out[M.KV_BLOCKS_TOTAL] = self._pool
        if self.runner.cache is not None:
            out[M.GRAPH_POOL_MB] = self.runner.steps.memory_bytes() / 2**20
        out.update(self.speculation.metrics(out, self.policy_version))
        out.update(self.verifier.metrics())
        self._metrics = RolloutMetrics()
        return out

    @property
    def batch_trace(self) -> list[tuple[float, int, int, bool]]:
        """(seconds into the call, live batch, tokens emitted, speculated) per decode step since stats()."""
        return self._metrics.batch_trace

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams | None = None,
                 use_tqdm: bool = False, partial: PartialRound | None = None,
                 sample_keys: list[int] | None = None) -> list[RolloutResult]:
        """Sample params.n completions per prompt; one flat list, prompt-major, in order.

        partial: the call is one round of partial rollouts (rollout/types.py PartialRound): per prompt the samples
        it lists (carried ones continue), stopping when the round has what it needs; the unfinished samples come
        back with finish_reason "partial".
        sample_keys: one distinct int in [0, 2**62) per sequence, in result order: the target's draws for a sample
        are then a hash of its key and position (rollout/runtime/draws.py), whatever it is batched with or however
        it is stopped and carried on; None: the call's generator, seeded by params.seed."""
        params = params or SamplingParams()
        check_request(prompt_token_ids, params, self.max_model_len, self.max_num_seqs, self.model.cfg.vocab_size)
        if params.penalised and self.spec.lossy:
            # a lossy mode's behaviour law (rollout/lossy/law.py) is derived for a history-free processing
            raise ValueError("repetition_penalty is not supported with a lossy mode (verification=judge or "
                             "step_routing); use exact verification, or repetition_penalty=1.0")
        # the generator lives where sampling happens: on the engine's device
        gen = torch.Generator(device=self.runner.device).manual_seed(params.seed) if params.seed is not None else None
        stop_ids = set(params.stop_token_ids or []) | (set() if params.ignore_eos else self.eos_token_ids)
        if partial is None:
            seqs = [Sequence(i, j, list(p), min(params.max_new_tokens, self.max_model_len - len(p)))
                    for i, p in enumerate(prompt_token_ids) for j in range(params.n)]
            groups, by_prompt = [seqs[i * params.n:(i + 1) * params.n] for i in range(len(prompt_token_ids))], None
        else:
            seqs, groups, by_prompt = round_sequences(prompt_token_ids, partial, params, self.max_model_len, stop_ids)
        # the target's draws; drafters keep gen
        draws = call_draws(gen, sample_keys, seqs, params, self.runner.device, self.runner.transfers.to_device)
        longest = max(len(s.prompt_ids) + s.max_new_tokens for s in seqs)
        self.runner.refresh_weights()
        cache = self.runner.ensure_cache(min(len(seqs), self.max_num_seqs), longest + self._draft_slack(),
                                         self.speculation.extra_kv_layers, min_positions=longest,
                                         side=self.speculation.side_buffers)
        cache.reset()  # an earlier call that raised may have left blocks held
        self.speculation.calibrate(self.runner, cache.rows, cache.length)
        # the repetition penalty's per-row token sets, on the device beside the KV table (only when asked for)
        to_device = self.runner.transfers.to_device
        history = TokenHistory(cache.rows, self.model.cfg.vocab_size, self.runner.device, to_device) \
            if params.penalised else None
        # a learned drafter keeps per-call state; its sampled drafts draw from the call's keys where it has them
        self.speculation.start(seqs, cache, params, gen, history, draws if isinstance(draws, KeyedDraws) else None)
        self.proposer.start(seqs, params, gen)
        sched = Scheduler(groups, cache.rows, cache.alloc)
        ledger = KVLedger(cache, sched, () if history is None else (history,))  # history rows move with the table
        lean = lean_plain(self.proposer, self.verifier, history)
        ahead = lean and self.look_ahead and partial is None and (params.greedy or isinstance(draws, KeyedDraws))
        ctx = Call(params, draws, stop_ids, _progress(len(seqs), use_tqdm), time.perf_counter(), ledger, history,
                   lean=lean, ahead=ahead, carry=self.carry_ended, again=lean and partial is None and not ahead)
        # no op of the loop records autograd history: inference mode spares each of them the autograd dispatch
        # (a quarter of a plain step's host time on a small model); state that outlives the call is made outside it
        with torch.inference_mode():
            self._loop(sched, ctx, partial, by_prompt, seqs)
        if ctx.bar is not None:
            ctx.bar.close()
        pool = self.runner.cache  # after any growth during the call
        self._pool = (pool.nbytes() / 2**20, float(pool.alloc.capacity))
        self._metrics.record_call(seqs, time.perf_counter() - ctx.t0, pool.alloc.stats, sched.preemptions)
        self.verifier.record(seqs)
        self._signal_idle(True)  # between rollouts the drafter may train
        if self.free_kv_between_rollouts:  # a small pool stays with its CUDA graphs (docs/runtime.md)
            self.runner.release(keep=True)
        return [s.result(self.policy_version) for s in seqs]

    def _loop(self, sched: Scheduler, ctx: Call, partial: PartialRound | None, by_prompt, seqs) -> None:
        """admit -> prefill -> (make room -> decode step -> retire) until no work is left or the round is over."""
        while sched.has_work:
            groups = sched.admit()
            if groups:
                self._prefill(groups, ctx)
                self._retire(ctx)  # a first token may already end a sample
            elif not sched.live:
                raise RuntimeError("the scheduler admitted nothing with nothing live (a KV accounting bug)")
            if sched.live:
                ctx.kv.make_room(on_evict=self.speculation.evict)
                self._decode_step(sched.live, ctx)
                self._retire(ctx)
            if by_prompt is not None and round_over(partial, by_prompt, ctx.steps):
                self._stop_round(seqs)
                return

    def release_kv(self) -> None:
        """Give the KV pool (and the CUDA graphs over it) back, e.g. to the policy update; the next
        generate() allocates it again. generate() does this itself when free_kv_between_rollouts is on."""
        self.runner.release()

    # ---- the loop's stages --------------------------------------------------------------------
    def _prefill(self, groups: list[list[Sequence]], ctx: Call) -> None:
        """Admitted groups: recompute the KV of resumed (preempted) sequences; for fresh groups prefill each
        prompt once, share its full blocks with the group's other samples and sample every sequence's
        first token (one host transfer for all of them)."""
        fresh = [g for g in groups if not g[0].resumed]
        resumed = [g[0] for g in groups if g[0].resumed]
        if resumed:
            self._resume(resumed, ctx)
        if not fresh:
            return
        ctx.kv.prompt_blocks(fresh)
        heads = [g[0].row for g in fresh]
        logits, hiddens = self.runner.prefill([g[0].prompt_ids for g in fresh], heads, self.speculation.aux_layers)
        self.speculation.observe_prefill(fresh, hiddens)
        ctx.kv.share_prompts(fresh)
        sizes = torch.tensor([len(g) for g in fresh], device=logits.device)
        rows = logits.repeat_interleave(sizes, dim=0)  # [sum n, V]
        p = ctx.params
        seqs = [s for g in fresh for s in g]
        seen, at = None, None
        if ctx.history is not None:  # the first token's history is the prompt
            ctx.history.reset([s.row for s in seqs], [s.prompt_ids for s in seqs])
            at = torch.tensor([s.row for s in seqs], device=logits.device)
            seen = ctx.history.rows(at)
        toks = greedy_tokens(rows, seen, p) if p.greedy \
            else sample(probs_from_logits(rows, p, seen), bound(ctx.draws, seqs))
        if ctx.history is not None:
            ctx.history.mark(at, toks[:, None])
        host = self.runner.transfers.to_host(toks, logprobs_of(rows, toks, p), finite_flags(rows)).rows()
        self._check_finite(bad_rows([r[-1] for r in host]), seqs, ctx.steps,
                           f"the prefill after {ctx.steps} decode steps")
        for s, (tok, lp, _) in zip(seqs, host):
            s.append_one(int(tok), lp, ctx.stop_ids)
        ctx.finished = True
        self.speculation.begin(fresh)

    def _resume(self, seqs: list[Sequence], ctx: Call) -> None:
        """Preempted sequences are back: a prefill of everything they hold but the pending token rebuilds
        their KV, and a learned drafter's staged features with it (they lived in the freed blocks; the drafter
        rebuilds its own layer from them at its next catch-up). No token is drawn: each continues exactly
        where it stopped."""
        ctx.kv.resume_blocks(seqs)
        _, hiddens = self.runner.prefill([s.all_ids()[:s.cache_len] for s in seqs], [s.row for s in seqs],
                                         self.speculation.aux_layers)
        self.speculation.observe_resume(seqs, hiddens)
        if ctx.history is not None:  # everything it holds, the pending token included
            ctx.history.reset([s.row for s in seqs], [s.all_ids() for s in seqs])
        for s in seqs:
            s.resumed = False

    def _retire(self, ctx: Call) -> None:
        """Drop finished sequences (drafters, and a lossy mode's router, learn of them while they still hold
        their blocks) and refill their rows from the tail."""
        if not ctx.finished:
            return
        ctx.finished = False
        finished = ctx.kv.retire(on_finish=self._finish)
        if ctx.bar is not None and finished:
            ctx.bar.update(len(finished))

    def _stop_round(self, seqs: list[Sequence]) -> None:
        """A partial round is over: the samples still going stop where they are, unindexed by the drafters (they
        are not finished; the round that finishes them does that)."""
        going = [s for s in seqs if not s.finished]
        self.speculation.abandon(going)
        for s in going:
            s.finish_reason = "partial"

    def _finish(self, seq: Sequence) -> None:
        self.speculation.finish(seq)
        self.proposer.finish(seq)

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def selector(self):
        return self.speculation.selector

    @property
    def has_learned_drafter(self) -> bool:
        return self.speculation.learned is not None

    def warm_start_drafter(self, prompts: list[list[int]], *, budget_s: float, group: int, max_new_tokens: int,
                           temperature: float):
        """Train the learned drafter on this engine's own rollouts of `prompts` before RL starts, or load
        the cached result for these weights (rollout/speculation/training/warm_start.py)."""
        from rlspec.rollout.speculation.training.warm_start import warm_start

        return warm_start(self, prompts, budget_s=budget_s, group=group, max_new_tokens=max_new_tokens,
                          temperature=temperature)

    def drafter_intake(self):
        """Where a caller that computes drafter training samples itself (a trainer's forward pass,
        rollout/speculation/training/feature_tap.py) hands them: a DrafterIntake over the online trainer, whose
        claim() stops this engine banking its own finished samples; None without online training."""
        from rlspec.rollout.speculation.training.intake import TrainerIntake

        spec = self.speculation
        if spec.learned is None or spec.trainer is None:
            return None
        dtype = next(spec.learned.network().parameters()).dtype

        def stop_banking() -> None:
            spec.learned.bank_samples = False

        return TrainerIntake(lambda: spec.trainer, spec.aux_layers, dtype, on_claim=stop_banking)

    def export_drafter(self, path: str, metadata: dict | None = None) -> str:
        """Write the learned drafter (as trained so far) in the EAGLE-3 format vLLM and SGLang load."""
        meta = {"policy_version": self.policy_version, **(metadata or {})}
        return self.speculation.export_drafter(path, self.model.cfg.hf_config, meta)

    def state_dict(self) -> dict:
        """What the engine carries from one rollout to the next beyond the policy's weights (which the
        trainer pushes again): policy_version and the speculation state (selector statistics, model-free
        drafters' history, the learned drafter with its optimiser and buffer). For checkpoints."""
        return {"policy_version": self.policy_version, "speculation": self.speculation.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() saved (on resume, before the first rollout)."""
        self.policy_version = int(state["policy_version"])
        self.speculation.load_state_dict(state["speculation"])
        self.speculation.set_policy_version(self.policy_version)

    def close(self) -> None:
        """Stop background drafter training (the engine stays usable; the last drafter is kept)."""
        self.speculation.close()

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _signal_idle(self, idle: bool) -> None:
        """Compute is spare in the tail (a quarter of the rows or fewer still live) or between rollouts."""
        self.speculation.set_idle(idle)

    def _draft_slack(self) -> int:
        """Extra cache positions so padded drafts never write past the buffer (a drafted step included)."""
        return 1 + max(self.speculation.max_nodes, self.proposer.extra_nodes)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollout", unit="seq", leave=False)


def build_strategies(spec: SpecConfig, model, tokenizer, speculation: Speculation) -> tuple[Proposer, Verifier]:
    """The config's proposer and verifier (rollout/registry.py STRATEGIES): lossless speculation unless
    SpecConfig opts into a lossy mode (judge verification or step routing)."""
    return STRATEGIES.build("lossy" if spec.lossy else "exact", spec, model, tokenizer, speculation)
