"""LossyControl: the proposer and the verifier of the lossy modes (SpecConfig.lossy), one object in both roles
of rollout/speculation/strategies.py, since the router's state spans a step's proposal and its verdict.

Per decode step: `propose` gives rows at the start of a reasoning step a whole drafted step from
the step source (Arbitrage) and the others the selector's usual draft; `verify` scores, judges,
routes and verifies the chain batch (rollout/lossy/judge.py: the lossless chain kernel with the judge
and the router as its acceptance test) and hands the engine, as columns of the step's one host
transfer, per accepted position its token_source and the exact law it was emitted with
(rollout/lossy/law.py); `provenance` turns those host rows into each row's sources and behaviour
logprobs; `after_commit` tracks where steps end. `metrics` reports the lossy share, routed steps, judge
acceptances and importance-ratio statistics. Tree batches (an adaptive selector's tree arm) are
verified losslessly: the lossy rules are defined on chains.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import replace

import torch

from rlspec.rollout.lossy.heads import OnlineHead
from rlspec.rollout.lossy.judge import JUDGE, TARGET, judge_accepts, judge_labels, judge_vocab, target_probs, \
    verify_lossy_chain
from rlspec.rollout.lossy.router import agreement_labels, likelihood_scores, step_features
from rlspec.rollout.config_checks import DRAFT_MODEL_PREFIX
from rlspec.rollout.lossy.steps import StepBoundary
from rlspec.rollout.registry import STRATEGIES
from rlspec.rollout.speculation.drafters.base import Draft
from rlspec.rollout.speculation.strategies import ExactVerifier, Provenance, chain_verdict
from rlspec.rollout.types import LOSSY_SOURCES, TOKEN_SOURCES

HEAD_EXAMPLES_PER_STEP = 64  # judge examples banked per verify (a random subset: bounded cost)


class LossyControl:
    def __init__(self, spec, model, tokenizer, speculation):
        self.spec, self.speculation = spec, speculation
        cfg = model.cfg
        self.judge_on = spec.verification == "judge"
        self.routing = spec.step_routing == "arbitrage"
        self.judge_head = OnlineHead(cfg.hidden_size) if self.judge_on and spec.judge == "learned" else None
        self.router_head = OnlineHead(cfg.hidden_size, seed=1) if self.routing and spec.router == "learned" else None
        self.final_layer = cfg.num_layers  # hiddens[L]: the last layer's output (pre-norm)
        self.boundary = StepBoundary.from_tokenizer(tokenizer, cfg.vocab_size, spec.step_delimiter) \
            if self.routing else None
        # who writes a step: a local draft model (DraftModelSource) or one of the engine's drafters
        self.draft_model, self.step_drafter = self._step_source(spec, model, tokenizer) if self.routing else (None, None)
        self.open: dict[int, bool] = {}  # id(seq) -> at a step the router may take (no rejection yet)
        self._exact = ExactVerifier()  # tree batches: the lossy rules are defined on chains
        self._gen = torch.Generator().manual_seed(0)
        self._reset_counters()

    def _step_source(self, spec, model, tokenizer):
        src = spec.step_source or self.speculation.names[0]  # None: the engine's (first) drafter
        if src.startswith(DRAFT_MODEL_PREFIX):
            from rlspec.rollout.lossy.draft_model import DraftModelSource

            p = next(model.parameters())
            path = src[len(DRAFT_MODEL_PREFIX):]
            return DraftModelSource(path, tokenizer, model.cfg.vocab_size, p.device, p.dtype), None
        if src not in self.speculation.by_name:
            raise ValueError(f"step_source {src!r} is not a drafter of this engine ({self.speculation.names})")
        return None, self.speculation.by_name[src]

    # ---- per call / per step -------------------------------------------------------------------
    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.final_layer,) if self.judge_head is not None or self.router_head is not None else ()

    @property
    def extra_nodes(self) -> int:
        return self.spec.step_max_tokens if self.routing else 0

    def start(self, seqs, params, generator) -> None:
        self.params = params
        self.open = {id(s): True for s in seqs}
        if self.draft_model is not None:
            self.draft_model.start(params, generator)

    def propose(self, live, arm, room) -> tuple[list[Draft], list[bool]]:
        """Drafts for the live batch and which rows carry a whole drafted step (room: the engine's
        draft-node allowance per row, which also takes KV blocks for the drafted positions)."""
        routed = [self.routing and arm.width == 1 and self.open.get(id(s), True) for s in live]
        caps = room([self.spec.step_max_tokens if r else arm.nodes for r in routed])
        drafts = [Draft() for _ in live]
        other = [i for i, r in enumerate(routed) if not r]
        if other:
            for i, d in zip(other, self.speculation.propose(arm, [live[i] for i in other], [caps[i] for i in other])):
                drafts[i] = d
        step = [i for i, r in enumerate(routed) if r]
        if step:
            for i, d in zip(step, self._draft_steps([live[i] for i in step], [caps[i] for i in step])):
                drafts[i] = d
                routed[i] = len(d) > 0
        return _one_q_kind(drafts), routed

    def _draft_steps(self, seqs, caps: list[int]) -> list[Draft]:
        """Whole steps, drafted deterministically (a point mass given the context): a router keeps or
        rejects a step by its content, and the law of a sampled step under that choice would need a sum
        over every step the source could write (docs/lossy.md#the-exact-behaviour-law)."""
        if self.draft_model is not None:
            return self.draft_model.propose(seqs, caps, self.boundary)
        if self.step_drafter is self.speculation.learned:  # the learned drafter: a whole step, no early stop
            self.step_drafter.set_stop_rule("none")
        with _greedy_drafts(self.step_drafter):
            drafts = self.step_drafter.propose(seqs, caps, 1)
        out = []
        for s, d in zip(seqs, drafts):
            n = self.boundary.cut(s.pending, d.tokens)
            out.append(Draft.chain(d.tokens[:n], None if d.q is None else d.q[:n]))
        return out

    def verify(self, logits, hiddens: dict, batch, params, generator, routed: list[bool]):
        """Lossy chain verification -> StepVerdict whose columns are source [B, K], the EmitLaw's logm and
        own [B, K+1] and keep [B, 1], on the device. A tree batch is verified exactly (no columns)."""
        if not batch.is_chain:
            return self._exact.verify(logits, hiddens, batch, params, generator)
        x, num = batch.tokens[:, 1:], batch.num_drafts
        B, K = x.shape
        dev = logits.device
        mask = torch.arange(K, device=dev)[None, :] < num[:, None]
        p_all = target_probs(logits, params)  # [B, K+1, V], once: the verify reuses it
        p = p_all[:, :K]
        hid = hiddens.get(self.final_layer)
        hid = hid[:, 1:] if hid is not None else None  # node j+1 holds draft token j
        judged, judged_v = self._judge(p, x, mask, hid, batch.q is not None and not params.greedy) \
            if self.judge_on and K else (None, None)
        routed_t = torch.tensor(routed, device=dev)
        keep = self._route(logits[:, :K], p, x, batch.q, mask & routed_t[:, None], routed_t, hid, params) \
            if self.routing and any(routed) and K else None
        verdict, source, law = verify_lossy_chain(logits, x, num, params, batch.q, generator, judged, keep,
                                                  None if params.greedy else p_all, judged_v)
        keep = torch.zeros(B, dtype=torch.bool, device=dev) if keep is None else keep
        self.steps_routed += sum(routed)
        return chain_verdict(verdict, K, (source, law.logm, law.own, keep[:, None]))

    def _judge(self, p, x, mask, hid, sampled: bool):
        """-> (judged [B, K], judged over the vocabulary [B, K, V] or None). A sampled draft's exact law
        needs the verdict on every token (rollout/lossy/law.py): the rules that read p give it; the
        learned head, which reads the state after the drafted token, judges point-mass drafts only."""
        head = self.judge_head
        if head is None:
            if not sampled:
                return judge_accepts(self.spec.judge, self.spec.judge_threshold, p, x) & mask, None
            vocab = judge_vocab(self.spec.judge, self.spec.judge_threshold, p) & mask[..., None]
            return vocab.gather(-1, x[..., None]).squeeze(-1), vocab
        if hid is not None:
            feats, labels = hid[mask], judge_labels(p, x)[mask]
            pick = torch.randperm(feats.shape[0], generator=self._gen)[:HEAD_EXAMPLES_PER_STEP].to(feats.device)
            head.add(feats[pick], labels[pick])
        if not head.ready:  # untrained: judge nothing, verification stays exact
            return torch.zeros_like(mask), None
        return judge_accepts("learned", self.spec.judge_threshold, p, x, head.score(hid)) & mask, None

    def _route(self, logits, p, x, q, mask, routed_t, hid, params):
        head = self.router_head
        if head is None:
            temp = 1.0 if params.greedy else params.temperature
            return (likelihood_scores(logits, p, x, mask, temp) >= self.spec.route_threshold) & routed_t
        feats = step_features(hid, mask)
        q_x = torch.ones_like(x, dtype=p.dtype) if q is None else q.gather(-1, x[..., None]).squeeze(-1)
        head.add(feats[routed_t], agreement_labels(p, x, q_x, mask)[routed_t])
        if not head.ready:  # untrained: keep nothing, the target regenerates every step
            return torch.zeros_like(routed_t)
        return (head.score(feats) >= self.spec.route_threshold) & routed_t

    def provenance(self, columns: list[list[float]], accepted: list[int], lps: list[list[float]]) -> Provenance:
        """The host rows of verify's columns -> per row the sources and behaviour logprobs of the accepted
        drafts + the token after them, and whether the router kept the row's drafted step. The behaviour
        logprob of a token is log m, the exact law the whole pipeline emitted it with, where that differs
        from the target's law, and the target's logprob lps (what lossless speculation records) where not."""
        K = (len(columns[0]) - 3) // 3  # source K, logm K+1, own K+1, keep 1
        srcs, behs, kept = [], [], []
        for r, a, lp in zip(columns, accepted, lps):
            srcs.append([int(v) for v in r[:a]] + [TARGET])
            behs.append([r[K + j] if r[2 * K + 1 + j] else lp[j] for j in range(a + 1)])
            kept.append(bool(r[3 * K + 2]))
        self.steps_kept += sum(kept)
        return Provenance(srcs, behs, kept)

    def after_commit(self, live, before: list[int], routed: list[bool], kept: list[bool]) -> None:
        """A rejected step closes the router's chance until the step ends; a delimiter opens the next."""
        if not self.routing:
            return
        for s, n0, r, k in zip(live, before, routed, kept):
            if r and not k:
                self.open[id(s)] = False
            ids = s.completion_ids
            if any(self.boundary.closes(ids[j - 1] if j else None, ids[j]) for j in range(max(n0, 0), len(ids))):
                self.open[id(s)] = True

    def finish(self, seq) -> None:
        self.open.pop(id(seq), None)
        if self.draft_model is not None:
            self.draft_model.finish(seq)

    # ---- metrics -------------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.steps_routed = self.steps_kept = 0
        self.by_source = [0] * len(TOKEN_SOURCES)
        self.ratio_sum = self.ratio_lossy_sum = 0.0
        self.ratio_min, self.ratio_max = math.inf, 0.0
        self.tokens = 0

    def record(self, seqs) -> None:
        """Count a finished call's tokens by source and their importance ratios pi_target / pi_behaviour."""
        for s in seqs:
            for src, lp, blp in zip(s.token_source, s.logprobs, s.behaviour_logprobs):
                ratio = math.exp(max(min(lp - blp, 50.0), -50.0))
                self.by_source[src] += 1
                self.tokens += 1
                self.ratio_sum += ratio
                self.ratio_min, self.ratio_max = min(self.ratio_min, ratio), max(self.ratio_max, ratio)
                if src in LOSSY_SOURCES:
                    self.ratio_lossy_sum += ratio

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        lossy = sum(self.by_source[i] for i in LOSSY_SOURCES)
        out = {"rollout/lossy_token_share": lossy / n,
               "rollout/judge_acceptances": float(self.by_source[JUDGE]),
               "rollout/steps_routed": float(self.steps_routed),
               "rollout/steps_kept": float(self.steps_kept),
               "rollout/step_keep_rate": self.steps_kept / max(self.steps_routed, 1),
               "rollout/is_ratio/mean": self.ratio_sum / n,
               "rollout/is_ratio/min": self.ratio_min if self.tokens else 1.0,
               "rollout/is_ratio/max": self.ratio_max if self.tokens else 1.0,
               "rollout/is_ratio/lossy_mean": self.ratio_lossy_sum / lossy if lossy else 1.0}
        for i, name in enumerate(TOKEN_SOURCES):
            out[f"rollout/token_source/{name}"] = self.by_source[i] / n
        if self.judge_head is not None:
            out["rollout/judge_head_labels"] = float(self.judge_head.seen)
        if self.router_head is not None:
            out["rollout/router_head_labels"] = float(self.router_head.seen)
        self._reset_counters()
        return out


@STRATEGIES.register("lossy")
def _lossy(spec, model, tokenizer, speculation) -> tuple[LossyControl, LossyControl]:
    """One object in both roles: the router's state spans a step's proposal and its verdict."""
    control = LossyControl(spec, model, tokenizer, speculation)
    return control, control


@contextmanager
def _greedy_drafts(drafter):
    """A drafter that samples at the call's temperature (EAGLE-3 reads its `params`) drafts greedily
    inside: its step is then the argmax chain of its processed distribution, a point mass."""
    params = getattr(drafter, "params", None)
    if params is None or params.greedy:
        yield
        return
    drafter.params = replace(params, temperature=0.0)
    try:
        yield
    finally:
        drafter.params = params


def _one_q_kind(drafts: list[Draft]) -> list[Draft]:
    """Verification needs every non-empty draft of a batch to carry q or none to: a deterministic draft
    beside sampled ones (a suffix step next to an eagle3 chain) gets its exact equivalent, a one-hot q."""
    qs = [d.q for d in drafts if len(d) and d.q is not None]
    if not qs or all(d.q is not None for d in drafts if len(d)):
        return drafts
    V, like = qs[0].shape[-1], qs[0]
    out = []
    for d in drafts:
        if len(d) and d.q is None:
            q = like.new_zeros(len(d), V).scatter_(1, torch.tensor(d.tokens, device=like.device)[:, None], 1.0)
            d = Draft(d.tokens, d.parents, q)
        out.append(d)
    return out
