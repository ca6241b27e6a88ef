"""The decode step, for the whole live batch at once, the same in every mode:

    schedule -> propose -> one target forward -> verify -> one host transfer -> commit

`DecodeSteps` is the part of RolloutEngine (rollout/engine.py) that runs it; `Call` is what one generate call's
stages share. Host work a step is kept to what the step needs: a plain step (no row drafted) asks for no draft room,
sends [pending, start] to the device in one copy, draws without building a path and trims no blocks; every copy
goes through the runner's funnel (runtime/transfers.py) and the transfer's columns are StepLayout's
(rollout/step_layout.py). docs/runtime.md#host-step-budget.

Plain steps look ahead where the device runs them while the host works (CUDA: `Call.ahead`): a plain step's
successor is launched on the step's tokens, still on the device, before the host reads the step, so the device
runs step n + 1 while the host commits step n. The host learns of a finished row a step late and drops what the
step after its end made for it; every other row's next token is the one the step-by-step loop draws (greedy, or
keyed draws: each row's uniforms are its key's at its position, whatever else the step held). A learned drafter's
features of a plain step are staged as the step is launched, at the positions it writes, so a call with one looks
ahead too. A speculative step's are staged behind its transfer, before the host reads it, from the verifier's counts
on the device, and after a verify of its own drafts the drafter's next catch-up runs there too (CUDA): the host
waits for the verify alone. Chains drafted on the device look ahead too (rollout/chains_ahead.py).

Where nothing looks ahead (a CPU, where the host is the device, or draws from the call's generator), a plain step
still launches its successor from its drawn tokens on the device, after its commit, while the loop's pass between
two steps would do nothing (no row ended, no group to admit, no block to take by preempting): the same step, without
that pass and the copy of the rows' pending tokens and lengths.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import torch

from rlspec.rollout.chains_ahead import AheadChains, carry_ended
from rlspec.rollout.nonfinite import nonfinite_error
from rlspec.rollout.runtime.device import Span
from rlspec.rollout.runtime.draws import KeyedDraws, bound
from rlspec.rollout.runtime.history import TokenHistory
from rlspec.rollout.runtime.kv_ledger import KVLedger
from rlspec.rollout.runtime.sampling import logprobs_of, penalise
from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.runtime.transfers import Pending
from rlspec.rollout.speculation.draft_batch import DraftBatch, build_draft_batch
from rlspec.rollout.speculation.drafters.base import DraftTensors
from rlspec.rollout.speculation.strategies import ExactVerifier, SelectorProposer, StepVerdict
from rlspec.rollout.speculation.verify import draw_plain
from rlspec.rollout.step_layout import HostStep, StepLayout
from rlspec.rollout.types import SamplingParams

_FINISH_REASON = operator.attrgetter("finish_reason")  # None, or a reason (a non-empty str)


@dataclass
class Call:
    """What one generate call's stages share."""

    params: SamplingParams
    draws: torch.Generator | KeyedDraws | None  # where the target's uniforms come from
    stop_ids: set[int]
    bar: object
    t0: float
    kv: KVLedger  # the call's block bookkeeping
    history: TokenHistory | None = None  # per-row token sets, when a repetition penalty is on
    steps: int = 0  # decode steps run so far (errors name the step)
    finished: bool = False  # a sample finished since the last retire
    lean: bool = False  # plain steps may take DecodeSteps._plain_step (`lean_plain`)
    ahead: bool = False  # lean plain steps launch their successor before the host reads them (module docstring)
    carry: bool = True  # look-aheads go on past rows that ended while retiring them admits none (carry_ended)
    again: bool = False  # where they do not, a lean plain step launches the next itself (DecodeSteps._plain_again)
    due: list | None = None  # in a run of plain steps: the steps a row crosses into a new block (_plain_again)
    chosen: tuple = ()  # (live rows, arm) chosen for the next step by a look-ahead that did not launch it


@dataclass
class PlainLaunch:
    """A plain step in flight: its drawn tokens [B] on the device and its one host transfer."""

    token: torch.Tensor
    rows: Pending
    fresh: bool  # it captured or compiled its graph first: no measure of a step's cost
    ahead: bool  # launched before the host read the step in front of it


def lean_plain(proposer, verifier, history) -> bool:
    """Whether a plain step is read by nothing but its draw and a learned drafter's staging of its features: no
    proposer that drafts whole steps (a router), no verifier with columns of its own (a lossy mode), no repetition
    penalty's history. (A plain step's features go to the positions it writes, known before it runs: they are
    staged as it is launched, `_launch_plain`.)"""
    return type(proposer) is SelectorProposer and type(verifier) is ExactVerifier and history is None


class DecodeSteps(AheadChains):
    """RolloutEngine's decode step (needs its runner, speculation, proposer, verifier and metrics)."""

    def _decode_step(self, live: list[Sequence], ctx: Call) -> None:
        """schedule -> propose -> one target forward -> verify -> one host transfer -> commit."""
        arm = ctx.chosen[1] if ctx.chosen and ctx.chosen[0] == len(live) else self.speculation.choose(len(live))
        ctx.chosen = ()
        ctx.steps += 1
        if ctx.lean and not arm.speculative:
            return self._plain_step(live, arm, ctx, time.perf_counter())
        drafter = self._ahead_drafter(arm, live, ctx)
        if drafter is not None:  # a chain drafted on the device: its successors looked ahead (chains_ahead.py)
            return self._chain_steps(live, arm, ctx, drafter)
        roomy = []  # whether the proposer took draft room (blocks past the pending token) this step
        lens = [s.cache_len for s in live]  # read by the room, its blocks and the verify's layout

        def room(nodes: list[int]) -> list[int]:
            roomy.append(True)
            return ctx.kv.draft_room(live, self._draft_caps(live, nodes, lens), lens)

        span = Span(self.runner.device).start()  # a learned drafter's drafts are drawn on the device after it returns
        drafts, routed = self.proposer.propose(live, arm, room)
        span.stop()
        drafted = drafts.counts() if isinstance(drafts, DraftTensors) else [len(d.tokens) for d in drafts]
        batch = build_draft_batch([s.pending for s in live], drafts, lens, self.runner.transfers.to_device)
        logits, hiddens = self.runner.step(batch.tokens, batch.start, batch.depths, batch.tree_mask,
                                           self.speculation.aux_layers + self.verifier.hidden_layers,
                                           top=batch.kv_len - batch.N - 1)
        verdict = self.verifier.verify(self._penalised(logits, batch, ctx), hiddens, batch, ctx.params,
                                       bound(ctx.draws, live), routed)
        learned = self.speculation.learned is not None
        emitted = self._emitted(verdict, batch) if learned else None  # the drafter's to read (else _send's, if any)
        layout, sent = self._send(logits, verdict, batch, ctx, live, emitted)  # logprobs from the raw logits
        if learned:  # queued behind the transfer, run while the host reads it: features staged, an early catch-up
            accepted = verdict.accepted if batch.N else None
            self.speculation.observe_verify(live, hiddens, None if batch.is_chain else verdict.path, accepted,
                                            tokens=emitted)
        self.speculation.settle()  # what drafters deferred from finishing samples, while the device runs the step
        step = self._read(layout, sent, verdict, live, ctx)
        if learned:
            self.speculation.observe_commit(live, step.accepted, logits)
        before = [len(s.completion_ids) for s in live]
        emitted = self._commit(live, step, batch.is_chain, ctx)
        self.proposer.after_commit(live, before, routed, step.kept)
        if roomy:  # rejected drafts (and room a short draft left) keep at most a spare block
            ctx.kv.trim(live)
        self._observe_step(arm, live, drafted, routed, step.accepted, emitted, span, ctx)

    def _plain_step(self, live: list[Sequence], arm, ctx: Call, t0: float) -> None:
        """Steps no row drafts in, where nothing but the draw reads them (`lean_plain`): the same forward, draws,
        transfer and commit as the general step, without its drafting, path and layout objects (what a plain step
        costs the host is what the device waits for between steps: docs/runtime.md#host-step-budget). With
        ctx.ahead, each step's successor is launched before the host reads it (`_look_ahead`), for as long as
        the selector keeps choosing plain steps and no row ends whose retiring would admit a group (`carry_ended`).
        Without it, each step launches the next after its commit, for as long as the loop's pass between them would
        do nothing else (`_plain_again`). The ledger gets the general step's figures: from t0 to t1 its (empty)
        drafting, from t1 to the commit its step."""
        t1 = time.perf_counter()
        ctx.due = None  # a new run: the rows' blocks are asked for again
        lens = [s.cache_len for s in live]
        packed = self.runner.transfers.to_device([[s.pending, n] for s, n in zip(live, lens)])
        start, top = packed[:, 1], max(lens)
        step = self._launch_plain(packed[:, :1], start, top, live, ctx, 0)
        while True:
            ahead = self._look_ahead(live, ctx)
            if ahead is not None:  # a row that ended stays where it is (`carry_ended`)
                moved = 1 if not ctx.finished else \
                    self.runner.transfers.to_device([0 if s.finished else 1 for s in live])
                # top: a bound of max(start), within the table
                start, top = start + moved, min(top + 1, self.runner.cache.length - self._draft_slack())
                nxt = self._launch_plain(step.token[:, None], start, top, live, ctx, 1)
            t1 = self._commit_plain(step, live, arm, ctx, t0, t1)
            if ahead is None:
                t0 = time.perf_counter()  # the selector's figures as the loop's step takes them: its choice, then
                arm = self._plain_again(live, ctx)  # the step from its launch
                if arm is None:
                    break
                ctx.steps += 1  # every row moved on by its token: the loop's [pending, start] without its copy
                start, top, t1 = start + 1, top + 1, time.perf_counter()
                step = self._launch_plain(step.token[:, None], start, top, live, ctx, 0)
                continue
            ctx.steps += 1
            step, arm, t0 = nxt, ahead, t1
            if ctx.finished and not carry_ended(live, ctx):  # the rows going take their next token; the loop
                self._commit_plain(step, live, arm, ctx, t0, t1)  # retires the others and admits
                break
        ctx.kv.trim(live)  # the look-aheads' blocks are the rows' own now: this only forgets it gave them

    def _launch_plain(self, tokens, start, top: int, live: list[Sequence], ctx: Call, ahead: int) -> PlainLaunch:
        """One plain step's forward, draw and host transfer, launched (nothing waits for the device); `ahead`:
        steps launched before it that the host has not read (their tokens are its input, still on the device).
        A learned drafter's features of the step are staged here, while they are the step's (a graph's outputs are
        the next replay's), at the positions the step writes: `ahead` past the rows' committed lengths."""
        logits, hiddens = self.runner.step(tokens, start, hidden_layers=self.speculation.aux_layers, top=top)
        token, row = draw_plain(logits[:, 0], ctx.params, bound(ctx.draws, live, ahead))
        # the step's transfer as the draw laid it out; greedy, or a truncated law: the logprob of the raw logits
        sent = (row,) if row is not None else \
            (token, logprobs_of(logits[:, 0], token, ctx.params), StepLayout.finite(logits))
        if self.speculation.learned is not None:  # the pending node only: a plain step accepts no draft
            self.speculation.observe_verify(live, hiddens, None, None, ahead)
            self.speculation.observe_commit(live, [0] * len(live), logits)
        launched = PlainLaunch(token, self.runner.transfers.to_host(*sent), self.runner.fresh, ahead > 0)
        self.speculation.settle()  # what drafters deferred from finishing samples, while the device runs the step
        return launched

    def _look_ahead(self, live: list[Sequence], ctx: Call):
        """The arm of the step after the one in flight when that step may be launched now (None otherwise): a
        look-ahead call, every row still going with a token to draw after this one (no step past a row's length),
        the selector choosing a plain step, and a block for each such row's next position."""
        if not ctx.ahead or min((s.remaining for s in live if not s.finished), default=0) < 2:
            return None
        going = [0 if s.finished else 1 for s in live]  # a row that ended needs no token, nor room
        arm = self.speculation.choose(len(live))
        if arm.speculative or ctx.kv.draft_room(live, going) != going:
            ctx.chosen = (len(live), arm)  # the next step's arm, as the loop would have chosen it
            return None
        return arm

    def _plain_again(self, live: list[Sequence], ctx: Call):
        """After a plain step's commit, where nothing looks ahead: the next step's arm when it is plain and the
        loop's pass before it would do nothing else (None otherwise): no row ended (none to retire), no waiting
        group that fits (none to admit) and each row's next position within its blocks or blocks free without
        preempting (make_room's usual case, asked only on the steps a row is due for a block: `Call.due`). The step
        is then launched from the drawn tokens still on the device: the step the loop would launch, from the same
        state, in the same order of draws, with less host work (a CPU's steps, or draws from one generator)."""
        if not ctx.again or ctx.finished or ctx.kv.sched.admits():
            return None
        if ctx.due is None:  # the run's first step: every row's next position, and when rows cross into new blocks
            if not ctx.kv.make_room(preempt=False):
                return None
            ctx.due = ctx.kv.due_for_blocks(ctx.steps)
        elif ctx.due[ctx.steps % len(ctx.due)] and not ctx.kv.make_room(preempt=False):
            return None
        arm = self.speculation.choose(len(live))
        if arm.speculative:
            ctx.chosen = (len(live), arm)  # the next step's arm, as the loop would have chosen it
            return None
        return arm

    def _commit_plain(self, step: PlainLaunch, live: list[Sequence], arm, ctx: Call, t0: float, t1: float) -> float:
        """Read a plain step (waiting for it), append each unfinished row's token, record the step; returns when
        the host had it."""
        rows = step.rows.rows()
        read = time.perf_counter()
        going = [i for i, s in enumerate(live) if s.finish_reason is None]  # a row ended a step ago drops its token
        bad = StepLayout.of(0, False).bad_rows(rows)
        if bad:
            self._check_finite([i for i in bad if i in going], live, ctx.steps, f"decode step {ctx.steps}")
        stop = ctx.stop_ids
        for i in going:
            s, row = live[i], rows[i]
            s.append_one(int(row[0]), row[1], stop)
            ctx.finished = ctx.finished or s.finish_reason is not None
        ctx.finished = ctx.finished or len(going) < len(live)  # or a row that ended a step ago
        zeros = [0] * len(live)  # drafted and accepted per row
        if not step.fresh:  # nothing drafted: a step that captured its graph first tells nothing
            self.speculation.observe_step(arm, len(live), read - t1, t1 - t0, zeros, zeros)
        self._metrics.record_verify(arm.drafter, zeros, zeros, step.ahead)
        self._metrics.batch_trace.append((read - ctx.t0, len(live), len(going), False))
        self._signal_idle(len(live) <= max(1, self.runner.cache.rows // 4))
        return read

    @staticmethod
    def _penalised(logits: torch.Tensor, batch: DraftBatch, ctx: Call) -> torch.Tensor:
        """The verify's logits after the repetition penalty, each node against its own history: the row's
        tokens plus the drafts on the path to it (rollout/runtime/history.py); unchanged without a penalty.
        The verifier applies temperature and truncation itself."""
        if ctx.history is None:
            return logits
        return penalise(logits, ctx.history.at_nodes(batch.tokens, batch.tree_mask), ctx.params)

    def _observe_step(self, arm, live, drafted, routed, accepted, emitted, span: Span, ctx: Call) -> None:
        """The selector's statistics (cost and acceptance of the arm), metrics, the idle signal. The step's seconds are
        the drafting's (`span`, device time: read after the step's transfer) and the rest of the step's wall time."""
        drafting = span.seconds()
        rest = time.perf_counter() - span.t0 - drafting
        if routed is not None and any(routed):
            # whole drafted steps are not the arm's drafts: keep them, and this step's time, out of its statistics
            drafted, accepted = [0 if r else n for n, r in zip(drafted, routed)], \
                [0 if r else a for a, r in zip(accepted, routed)]
        else:  # a step that captured its shape first is no measure of its cost: its acceptance alone
            fresh = self.runner.fresh
            self.speculation.observe_step(arm, len(live), None if fresh else rest, None if fresh else drafting,
                                          drafted, accepted)
        self._metrics.record_verify(arm.drafter, drafted, accepted)
        self._metrics.batch_trace.append((time.perf_counter() - ctx.t0, len(live), emitted, arm.speculative))
        self._signal_idle(len(live) <= max(1, self.runner.cache.rows // 4))

    def _draft_caps(self, live: list[Sequence], nodes: list[int], lens: list[int]) -> list[int]:
        """Most draft nodes each row may carry: `nodes`, within its token budget and the cache table (lens: the rows'
        cache lengths)."""
        room = self.runner.cache.length - self._draft_slack()  # padded rows still fit the table
        # a draft longer than the tokens still allowed cannot all be kept: the last one is the target's
        return [max(0, min(n, s.remaining - 1, room - c)) for s, n, c in zip(live, nodes, lens)]

    @staticmethod
    def _emitted(verdict: StepVerdict, batch: DraftBatch) -> torch.Tensor:
        """[B, N+1] on the device: the accepted drafts (node j+1 of a chain is draft j), then the next token at column
        `accepted` (the columns past it are never read); a plain step's drawn token."""
        if batch.N == 0:
            return verdict.next_token[:, None]
        drafts = batch.tokens[:, 1:] if batch.is_chain else batch.tokens.gather(1, verdict.path.clamp(min=0))
        nxt = verdict.next_token[:, None]
        return torch.cat([drafts, nxt], 1).scatter_(1, verdict.accepted[:, None], nxt)

    def _send(self, logits, verdict: StepVerdict, batch: DraftBatch, ctx: Call, live: list[Sequence],
              emitted: torch.Tensor | None, extra: tuple = ()) -> tuple[StepLayout, Pending]:
        """The step's ONE host transfer (StepLayout), launched: the emitted tokens (`_emitted`, None: worked out
        here if needed) and their target logprobs, computed on the device, with each row's "logits finite" flag, the
        verifier's own columns (a lossy mode's sources and behaviour logprobs) and `extra` columns after them. Where
        the draw wrote those first columns (`StepVerdict.row`: a CPU kernel's, un-penalised), they go as they are."""
        tree, dev = not batch.is_chain, logits.device
        layout = StepLayout.of(batch.N, tree)
        if verdict.row is not None and ctx.history is None:
            return layout, self.runner.transfers.to_host(verdict.row, *verdict.columns, *extra)
        emitted = self._emitted(verdict, batch) if emitted is None else emitted
        path, accepted = (None, None) if batch.N == 0 else (verdict.path, verdict.accepted)
        if not tree:  # token j is predicted at node j: the logits as they are, the flag over nodes 0..accepted
            lps = logprobs_of(logits, emitted, ctx.params)
            flags = layout.finite(logits) if accepted is None else layout.chain_finite(logits, accepted)
        else:  # the flag covers every logit the step used: those at the accepted path's nodes and the last one
            at = torch.cat([torch.zeros(len(live), 1, dtype=torch.long, device=dev), path.clamp(min=0)], 1)
            picked = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))  # the predicting nodes
            lps, flags = logprobs_of(picked, emitted, ctx.params), layout.finite(picked)
        if ctx.history is not None:  # the emitted tokens join their rows' histories, on the device
            keep = None if accepted is None else \
                torch.arange(emitted.shape[1], device=dev)[None, :] <= accepted[:, None]
            ctx.history.mark(torch.arange(len(live), device=dev), emitted, keep)
        return layout, layout.send(self.runner.transfers, accepted, path, emitted, lps, flags,
                                   (*verdict.columns, *extra))

    def _read(self, layout: StepLayout, sent: Pending, verdict: StepVerdict, live: list[Sequence],
              ctx: Call) -> HostStep:
        """The step's transfer on the host (waiting for it): NonFiniteLogitsError for a row whose flag says a logit
        was not finite."""
        rows = sent.rows()
        self._check_finite(layout.bad_rows(rows), live, ctx.steps, f"decode step {ctx.steps}")
        step = layout.read(rows)
        if verdict.columns:
            step.provenance = self.verifier.provenance(layout.columns(rows), step.accepted, step.lps)
        return step

    def _check_finite(self, rows: list[int], seqs: list[Sequence], step: int, where: str) -> None:
        """Raise NonFiniteLogitsError for these rows, whose flags (from the step's one host transfer) say
        non-finite."""
        if rows:
            # the pool now holds the non-finite keys and values this step wrote; a later call would read them
            # at masked positions, where attention weighs them by 0, and 0 x NaN is NaN: start it afresh
            self.release_kv()
            raise nonfinite_error(self.model, rows, step, where, seqs)

    def _commit(self, live, step: HostStep, is_chain: bool, ctx: Call, going: list[int] | None = None) -> int:
        """Append each row's accepted drafts + the token after them, with their target logprobs and, from a
        lossy verifier, sources and behaviour logprobs (lossless: drafts exact, the last token the target's);
        move the KV of an accepted tree path to consecutive slots. going: the rows to commit (None: all). Returns
        the number of tokens kept."""
        kept, prov, stop = 0, step.provenance, ctx.stop_ids
        for i in range(len(live)) if going is None else going:
            s, a = live[i], step.accepted[i]
            if a == 0 and prov is None:  # one token, the target's
                kept += s.append_one(step.tokens[i][0], step.lps[i][0], stop)
                continue
            path = None if is_chain else step.path[i]
            if path is not None and path[:a] != list(range(1, a + 1)):
                start = s.cache_len
                # the target's layers: a learned drafter's catch-up writes its own at the kept positions, and may
                # have run already (eagle3_catch_up.py)
                self.runner.cache.gather_positions(s.row, [start + n for n in path[:a]],
                                                   [start + 1 + j for j in range(a)], self.model.cfg.num_layers)
            src = [1] * a + [0] if prov is None else prov.sources[i]  # draft-exact..., target
            kept += s.append(step.tokens[i][:a + 1], step.lps[i][:a + 1], stop, src,
                             None if prov is None else prov.behaviour[i])
        ctx.finished = ctx.finished or any(map(_FINISH_REASON, live))  # (a C loop: no call a row)
        return kept
