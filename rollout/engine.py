"""RolloutEngine: the loop admit -> (draft) -> forward -> verify -> commit -> retire.

Bookkeeping (sequences, rows, stop rules) is plain Python; tensors live in the runner, sampling
and verification. Without a drafter every step is plain autoregressive decoding: a verify of zero
drafts, so there is one code path and speculation can only change speed, never the law sampled.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

import torch

from rollout.spec.draft_batch import DraftBatch, build_draft_batch
from rollout.spec.drafters.base import Draft, Drafter
from rollout.errors import PromptTooLongError
from rollout.metrics import RolloutMetrics
from rollout.runtime.model import loader
from rollout.runtime.runner import ModelRunner
from rollout.runtime.sampling import logprobs_of, probs_from_logits, sample
from rollout.runtime.sequence import Sequence
from rollout.spec.speculation import build_speculation
from rollout.spec.selectors.longtail import OFF, Arm
from rollout.types import RolloutResult, SamplingParams, SpecConfig
from rollout.spec.verify import verify_chain, verify_tree


class RolloutEngine:
    def __init__(self, model, tokenizer, spec: SpecConfig | None = None, max_model_len: int = 2048,
                 max_num_seqs: int = 64, eos_token_ids: Iterable[int] | None = None, drafter: Drafter | None = None,
                 graph_mode: str = "auto"):
        """Prefer from_pretrained / from_hf_model. `drafter` plugs in a custom Drafter instance."""
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec or SpecConfig()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        p = next(model.parameters())
        eos = list(eos_token_ids or [])
        if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = [tokenizer.eos_token_id]
        self.eos_token_ids = set(eos)
        self.policy_version = 0
        self._metrics = RolloutMetrics()
        self.drafters, self.selector = build_speculation(self.spec, model, drafter)
        self._drafter_version = 0
        # CUDA graphs (rollout/graphs.py) on GPUs, eager elsewhere; sized for the largest verify
        self.runner = ModelRunner(model, p.device, p.dtype, graph_mode, max_graph_t=self._draft_slack())

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str, spec: SpecConfig | None = None, device="cpu", dtype="bfloat16",
                        max_model_len: int = 2048, max_num_seqs: int = 64, graph_mode: str = "auto") -> "RolloutEngine":
        """model: a local HF directory, a hub id, or the embedded alias "smollm2-135m-instruct".
        graph_mode: CUDA graphs ("auto", "off", "lazy", "eager_start"; rollout/runtime/graphs.py)."""
        from transformers import AutoTokenizer

        from rollout.runtime.model.fetch import fetch_model

        path = fetch_model(model)
        runtime = loader.load_model(path, dtype=dtype, device=device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(runtime, tokenizer, spec, max_model_len, max_num_seqs, _generation_eos(path, tokenizer),
                   graph_mode=graph_mode)

    @classmethod
    def from_hf_model(cls, hf_model, tokenizer, spec: SpecConfig | None = None, dtype=None, device=None,
                      max_model_len: int = 2048, max_num_seqs: int = 64, graph_mode: str = "auto") -> "RolloutEngine":
        """Build from an in-memory transformers model (the trainer's policy); weights are copied.
        graph_mode: as in from_pretrained."""
        runtime = loader.from_hf_model(hf_model, loader.resolve_dtype(dtype) if dtype else None, device)
        eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else eos
        return cls(runtime, tokenizer, spec, max_model_len, max_num_seqs, eos, graph_mode=graph_mode)

    # ---- public surface ---------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Policy sync from the trainer (HF parameter names); bumps policy_version."""
        loader.load_named_tensors(self.model, named_tensors)
        self.policy_version += 1
        if self.drafters is not None:
            self.drafters.set_policy_version(self.policy_version)

    def stats(self) -> dict[str, float]:
        """Slash-named metrics accumulated since the previous call."""
        out = self._metrics.as_dict()
        out["rollout/policy_version"] = float(self.policy_version)
        if self.runner.cache is not None:
            out["rollout/kv_cache_mb"] = self.runner.cache.nbytes() / 2**20
            out["rollout/graph_pool_mb"] = self.runner.steps.memory_bytes() / 2**20
        if self.selector is not None and hasattr(self.selector, "metrics"):
            out.update(self.selector.metrics())
        if self.drafters is not None and self.drafters.learned is not None:
            name = self.drafters.learned.name
            out["drafter/accept_len"] = out.get(f"rollout/accept_len/{name}", 1.0)
            if self.drafters.trainer is not None:
                out.update(self.drafters.trainer.metrics(self.policy_version))
        self._metrics = RolloutMetrics()
        return out

    @property
    def batch_trace(self) -> list[tuple[float, int, int, bool]]:
        """(seconds into the call, live batch, tokens emitted, speculated) per decode step since stats()."""
        return self._metrics.batch_trace

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams | None = None,
                 use_tqdm: bool = False) -> list[RolloutResult]:
        """Sample params.n completions per prompt; one flat list, prompt-major, in order."""
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params)
        gen = torch.Generator(device=self.runner.device).manual_seed(params.seed) if params.seed is not None else None
        stop_ids = set(params.stop_token_ids or []) | (set() if params.ignore_eos else self.eos_token_ids)
        seqs = [
            Sequence(i, j, list(p), min(params.max_new_tokens, self.max_model_len - len(p)))
            for i, p in enumerate(prompt_token_ids) for j in range(params.n)
        ]
        longest = max(len(s.prompt_ids) + s.max_new_tokens for s in seqs)
        learned = self.drafters.learned if self.drafters is not None else None
        extra = self.drafters.extra_kv_layers if self.drafters is not None else 0
        self.runner.ensure_cache(min(len(seqs), self.max_num_seqs), longest + self._draft_slack(), extra)
        self._calibrate()
        if learned is not None:  # it keeps per-call state and a KV layer in the shared cache
            learned.target_cache = self.runner.cache
            learned.start(seqs, self.runner.cache.length, params, gen)
        t0 = time.perf_counter()
        waiting = deque(seqs[i * params.n:(i + 1) * params.n] for i in range(len(prompt_token_ids)))
        live: list[Sequence] = []
        bar = _progress(len(seqs), use_tqdm)
        while waiting or live:
            self._admit(waiting, live, params, gen, stop_ids)
            live = self._retire(live, bar)  # a first token may already end a sample
            if live:
                emitted, spec = self._decode_step(live, params, gen, stop_ids)
                self._metrics.batch_trace.append((time.perf_counter() - t0, len(live), emitted, spec))
                live = self._retire(live, bar)
        if bar is not None:
            bar.close()
        self._record_call(seqs, time.perf_counter() - t0)
        self._signal_idle(True)  # between rollouts the drafter may train
        return [s.result(self.policy_version) for s in seqs]

    # ---- the loop's stages --------------------------------------------------------------------
    def _admit(self, waiting: deque, live: list[Sequence], params, gen, stop_ids) -> None:
        """Prefill waiting prompt groups while rows are free; each group's n samples share one prefill."""
        groups = []
        while waiting and len(live) + sum(map(len, groups)) + len(waiting[0]) <= self.runner.cache.rows:
            groups.append(waiting.popleft())
        if not groups:
            return
        base = len(live)
        heads = []
        for g in groups:
            for s in g:
                s.row = base
                base += 1
            heads.append(g[0].row)
        logits, hiddens = self.runner.prefill([g[0].prompt_ids for g in groups], heads, self._aux_layers())
        if hiddens:
            self.drafters.learned.observe_prefill(groups, self._features(hiddens))
        for g, head_logits in zip(groups, logits):
            self.runner.cache.copy_row(g[0].row, [s.row for s in g[1:]], len(g[0].prompt_ids))
            first = self._sample_first(head_logits, len(g), params, gen)
            for s, (tok, lp) in zip(g, first):
                s.append([tok], [lp], stop_ids)
            live.extend(g)
        if self.drafters is not None:
            self.drafters.begin(groups)

    def _sample_first(self, logits: torch.Tensor, n: int, params, gen) -> list[tuple[int, float]]:
        rows = logits[None].expand(n, -1)
        toks = rows.argmax(-1) if params.greedy else sample(probs_from_logits(rows, params), gen)
        return list(zip(toks.tolist(), logprobs_of(rows, toks, params).tolist()))

    def _decode_step(self, live: list[Sequence], params, gen, stop_ids) -> tuple[int, bool]:
        """One target forward for the whole live batch: plain decode, or verify of each row's draft.
        Returns (tokens emitted, whether the step speculated)."""
        assert all(s.row == i for i, s in enumerate(live)), "live rows must be compact"
        arm = self.selector.choose(len(live)) if self.selector is not None else OFF
        t0 = time.perf_counter()
        drafts = self._propose(live, arm)
        t1 = time.perf_counter()
        batch = build_draft_batch([s.pending for s in live], drafts)
        start = torch.tensor([s.cache_len for s in live])
        logits, hiddens = self.runner.step(batch.tokens, start, batch.depths, batch.tree_mask, self._aux_layers())
        logits = logits.cpu()
        path, accepted, next_token = self._verify(logits, batch, params, gen)
        acc = accepted.tolist()
        if hiddens:
            self.drafters.learned.observe_verify(live, self._features(hiddens), path, acc)
        emitted = self._commit(live, logits, batch, path, accepted, next_token, params, stop_ids)
        drafted = [len(d) for d in drafts]
        if self.selector is not None:
            if self.drafters.version() != self._drafter_version:  # new weights: old evidence is stale
                self._drafter_version = self.drafters.version()
                self.selector.reset_acceptance(self.drafters.learned.name)
            self.selector.observe(arm, len(live), time.perf_counter() - t1, t1 - t0, drafted, acc)
        self._metrics.record_verify(arm.drafter, drafted, acc)
        self._signal_idle(len(live) <= max(1, self.runner.cache.rows // 4))
        return emitted, arm.speculative

    def _propose(self, live: list[Sequence], arm: Arm) -> list[Draft]:
        if not arm.speculative:
            return [Draft() for _ in live]
        room = self.runner.cache.length - self._draft_slack()  # padded rows still fit the buffer
        # a draft longer than the tokens still allowed cannot all be kept: the last one is the target's
        caps = [max(0, min(arm.nodes, s.remaining - 1, room - s.cache_len)) for s in live]
        return self.drafters.propose(arm, live, caps)

    def _verify(self, logits, batch: DraftBatch, params, gen):
        """Returns (path [B, N] accepted node indices, accepted [B], next_token [B])."""
        if batch.is_chain:
            v = verify_chain(logits, batch.tokens[:, 1:], batch.num_drafts, params, batch.q, gen)
            N = batch.tokens.shape[1] - 1
            steps = torch.arange(1, N + 1)[None, :].expand(len(v.accepted), N)
            path = torch.where(steps <= v.accepted[:, None], steps, -1)
            return path, v.accepted, v.next_token
        v = verify_tree(logits, batch.tokens, batch.children, params, batch.q, gen)
        return v.path, v.accepted, v.next_token

    def _commit(self, live, logits, batch: DraftBatch, path, accepted, next_token, params, stop_ids) -> int:
        """Append accepted drafts + the target's token with target logprobs; fix KV of tree paths.
        Returns the number of tokens kept."""
        B = len(live)
        at = torch.cat([torch.zeros(B, 1, dtype=torch.long), path.clamp(min=0)], 1)  # node predicting each token
        emitted = batch.tokens.gather(1, path.clamp(min=0))
        emitted = torch.cat([emitted, torch.zeros(B, 1, dtype=torch.long)], 1)
        emitted.scatter_(1, accepted[:, None], next_token[:, None])
        lps = logprobs_of(logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])), emitted, params)
        acc, emitted_l, lps_l, path_l = accepted.tolist(), emitted.tolist(), lps.tolist(), path.tolist()
        kept = 0
        for i, s in enumerate(live):
            a = acc[i]
            if not batch.is_chain and path_l[i][:a] != list(range(1, a + 1)):
                start = s.cache_len
                self.runner.cache.gather_positions(s.row, [start + n for n in path_l[i][:a]],
                                                   [start + 1 + j for j in range(a)])
            kept += s.append(emitted_l[i][:a + 1], lps_l[i][:a + 1], stop_ids)
        return kept

    def _retire(self, live: list[Sequence], bar) -> list[Sequence]:
        """Drop finished sequences and compact the survivors into rows 0..B-1."""
        survivors = [s for s in live if not s.finished]
        if bar is not None and len(survivors) < len(live):
            bar.update(len(live) - len(survivors))
        if self.drafters is not None:  # model-free drafters index finished samples; eagle3 banks them
            for s in live:
                if s.finished:
                    self.drafters.finish(s)
        for new_row, s in enumerate(survivors):
            if s.row != new_row:
                self.runner.cache.move(s.row, new_row, s.cache_len)
                s.row = new_row
        return survivors

    # ---- helpers ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop background drafter training (the engine stays usable)."""
        if self.drafters is not None and self.drafters.trainer is not None:
            self.drafters.trainer.stop()

    def _signal_idle(self, idle: bool) -> None:
        """Tell an online drafter trainer whether compute is spare: the tail (a quarter of the rows or
        fewer still live) or between rollouts."""
        if self.drafters is not None and self.drafters.trainer is not None:
            self.drafters.trainer.set_idle(idle)

    def _aux_layers(self) -> tuple[int, ...]:
        return self.drafters.aux_layers if self.drafters is not None else ()

    def _features(self, hiddens: dict) -> torch.Tensor:
        """EAGLE-3 features: the chosen layers' hidden states side by side [.., 3H]."""
        return torch.cat([hiddens[i] for i in self._aux_layers()], dim=-1)

    def _calibrate(self) -> None:
        """Seed the cost model once: dummy forwards per batch bucket at every verify size."""
        if self.selector is None or self.selector.costs.table:
            return
        sizes = sorted(set(self.selector.verify_sizes()))
        rows = self.runner.cache.rows
        ctx = min(128, self.runner.cache.length - max(sizes) - 1)
        self.selector.costs.calibrate(self.runner, rows, sizes, context=max(ctx, 1))

    def _draft_slack(self) -> int:
        """Extra cache positions so padded drafts never write past the buffer."""
        return 1 + (self.selector.max_nodes if self.selector is not None else 0)

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} samples per prompt exceed max_num_seqs={self.max_num_seqs}; "
                             "raise max_num_seqs")
        vocab = self.model.cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(p) >= self.max_model_len:
                raise PromptTooLongError(
                    f"prompt {i} has {len(p)} tokens but the engine's context is {self.max_model_len} tokens "
                    f"(max_model_len), leaving no room to generate; raise max_model_len (rollout.max_model_len "
                    "in a config) or shorten the prompt")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab})")

    def _record_call(self, seqs: list[Sequence], seconds: float) -> None:
        m = self._metrics
        m.time_s += seconds
        m.generate_calls += 1
        m.sequences += len(seqs)
        m.generated_tokens += sum(len(s.completion_ids) for s in seqs)
        m.completion_lens.extend(len(s.completion_ids) for s in seqs)


def _generation_eos(path: str, tokenizer) -> list[int]:
    """EOS ids as `generate` would use them: generation_config.json first, then the tokenizer."""
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollout", unit="seq", leave=False)
