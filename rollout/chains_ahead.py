"""Speculative steps looked ahead: a chain drafted on the device launches its successor before the host reads it.

A speculative step's host work (the read, the commit, the selector's statistics, the next proposal's bookkeeping)
is what a GPU idles through between two verifies, and it grows with the batch (docs/runtime.md#host-step-budget).
Plain steps already hide theirs (`DecodeSteps._plain_step`). A chain whose drafter can draft from the device alone
(`propose_ahead`: `ngram_device`, which appends each row's emitted tokens to its texts on the device and looks the
rows up there; EAGLE-3, whose catch-up over the step's kept nodes already ran there, `eagle3_catch_up.py`) can hide
it too: step n + 1 is built from step n's results while they are still on the device (each row's next pending token
is the one after its accepted drafts, its start moves by accepted + 1) and launched before the host reads step n.
The host then reads and commits step n while the device verifies step n + 1.

What the host does not know yet it bounds or leaves to the device. Every row gets the blocks for step n's longest
outcome plus step n + 1's drafts, or the successor is not launched (the loop then steps as before). Each row's draft
budget is the step-by-step loop's (`_draft_caps` after step n), worked out on the device, so the drafts are the
loop's. Each row's draws are its key's at its position (keyed draws, or greedy: `Call.ahead`), so every token is the
one the step-by-step loop emits (a learned drafter's sampled drafts draw from the keys too: ChainDraws._uniforms).
A row that step n ended is carried through step n + 1, whose results for it are dropped, as a plain look-ahead
drops a finished row's token; where retiring it would admit nothing it rides along frozen for longer
(`carry_ended`). A learned drafter's features of each chain step are staged at positions the device lays out
(`observe_verify(start=)`), so device chains look ahead beside one too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlspec.rollout.runtime.device import Span
from rlspec.rollout.runtime.draws import bound
from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.runtime.transfers import Pending
from rlspec.rollout.speculation.draft_batch import DraftBatch, build_draft_batch
from rlspec.rollout.speculation.drafters.base import Ahead
from rlspec.rollout.speculation.strategies import StepVerdict
from rlspec.rollout.step_layout import StepLayout


@dataclass
class ChainLaunch:
    """A chain step in flight: what its successor is built from, and its one host transfer."""

    arm: object
    batch: DraftBatch
    verdict: StepVerdict
    emitted: torch.Tensor  # [B, N + 1] on the device: the accepted drafts, then the next token
    layout: StepLayout
    sent: Pending
    drafted: list[int] | None  # draft nodes per row (None: launched ahead; they come back in its transfer)
    span: Span  # its drafting, on the device
    top: int  # max(start) as the host bounds it
    fresh: bool  # it captured or compiled first: no measure of a step's cost


def carry_ended(live: list[Sequence], ctx) -> bool:
    """Whether steps go on looking ahead past rows that ended, which ride along frozen (no budget, no room, their
    position kept) until the loop retires them. Plain steps (decode.py) and chains alike. While groups wait, as long
    as retiring them would admit none (the scheduler admits a waiting group whole, once its rows are free); in the
    long tail, where nothing waits and rows end one after another, for at most an eighth of the batch, or one row
    (their attention is the device's waste)."""
    ended = sum(s.finished for s in live)
    if not ctx.carry or ended >= len(live):
        return False
    sched = ctx.kv.sched
    if sched.waiting:
        return sched.rows - len(live) + ended < len(sched.waiting[0])
    return ended <= max(1, len(live) // 8)


class AheadChains:
    """DecodeSteps' chains looked ahead (module docstring); needs its runner, speculation, verifier and metrics."""

    def _ahead_drafter(self, arm, live: list[Sequence], ctx):
        """The arm's drafter when a chain of it may be looked ahead (None otherwise): a look-ahead call, a chain,
        and a drafter that drafts from the device alone (`propose_ahead`), ready to now (`ahead_ready`: the learned
        drafter's needs its early catch-up and its level graphs, and no new weights waiting). A chain cut by a stop
        rule too: each row keeps the drafts before its first unsure one, the device's count, which comes back with
        the step."""
        if not (ctx.ahead and arm.speculative and arm.width == 1):
            return None
        drafter = self.speculation.by_name[arm.drafter]
        if not hasattr(drafter, "propose_ahead"):
            return None
        ready = getattr(drafter, "ahead_ready", None)
        return drafter if ready is None or ready(live) else None

    def _chain_steps(self, live: list[Sequence], arm, ctx, drafter) -> None:
        """A chain step from the host's state, then, while the next arm is a chain of the same drafter with room
        for it, each step's successor launched before the host reads the step."""
        t0 = time.perf_counter()
        lens = [s.cache_len for s in live]
        caps = ctx.kv.draft_room(live, self._draft_caps(live, [arm.nodes] * len(live), lens), lens)
        span = Span(self.runner.device).start()
        drafts = self.speculation.draft(arm, live, caps)
        span.stop()
        lens = [s.cache_len for s in live]
        batch = build_draft_batch([s.pending for s in live], drafts, lens, self.runner.transfers.to_device)
        step = self._launch_chain(live, arm, batch, drafts.counts(), span, max(lens), bound(ctx.draws, live), ctx)
        stops = self.runner.transfers.to_device(sorted(ctx.stop_ids) or [-1])  # what ends a row's text
        while True:
            nxt = self._chain_ahead(live, step, drafter, stops, ctx)
            t0 = self._commit_chain(step, live, ctx, t0, drafter if nxt is not None else None)
            if nxt is None:
                break
            ctx.steps += 1
            step = nxt
            if ctx.finished and not carry_ended(live, ctx):  # the rows going take this step's tokens; the
                self._commit_chain(step, live, ctx, t0, None)  # loop retires the others and admits
                break
        ctx.kv.trim(live)

    def _chain_ahead(self, live: list[Sequence], step: ChainLaunch, drafter, stops: torch.Tensor,
                     ctx) -> ChainLaunch | None:
        """Step n + 1 launched from step n's results on the device, when the selector's next arm is a chain of the
        same drafter and every row has the blocks for step n's longest outcome and the arm's whole draft; else None,
        the arm kept for the loop's next step. Each row's draft budget is the step-by-step loop's (`_draft_caps`
        after step n), worked out on the device from its token budget and table room and step n's tokens."""
        arm = self.speculation.choose(len(live))
        room = self.runner.cache.length - self._draft_slack()
        space = [room - s.cache_len for s in live]  # positions left in the table past the pending one
        # those step n's tokens and the drafts take (none: a row that ended)
        far = step.batch.N + 1 + arm.nodes
        reach = [0 if s.finished else max(0, min(far, r)) for s, r in zip(live, space)]
        if self._ahead_drafter(arm, live, ctx) is not drafter or ctx.kv.draft_room(live, reach) != reach:
            ctx.chosen = (len(live), arm)
            return None
        accepted = step.verdict.accepted  # None: step n drafted nothing (a plain step's verdict)
        accepted = accepted if accepted is not None else step.emitted.new_zeros(len(live))
        # a row that ended has no budget: nothing more joins its text, and it stays where it is (`carry_ended`)
        budget, space = self.runner.transfers.to_device([[0 if s.finished else s.remaining for s in live], space])
        advance = torch.where(budget > 0, accepted + 1, 0)
        caps = torch.minimum(torch.minimum(budget - advance - 1, space - advance), budget.new_tensor(arm.nodes))
        start = step.batch.start + advance
        top = min(step.top + step.batch.N + 1, room)  # a bound of max(start): a row's budget ends it before room
        span = Span(self.runner.device).start()
        drafts = self.speculation.draft_ahead(arm, live, Ahead(step.emitted, accepted, budget, stops, start, top,
                                                               advance))
        span.stop()
        if drafts is None:  # the drafter cannot draft from the device this step: the loop steps (its room is trimmed)
            ctx.chosen = (len(live), arm)
            return None
        if drafts.kept is not None:  # a stop rule's: the drafts before each row's first unsure one
            caps = torch.minimum(caps, drafts.kept)
        pending = step.emitted.gather(1, accepted[:, None])
        batch = DraftBatch(torch.cat([pending, drafts.ids[:, 0]], 1), caps.clamp(min=0), True,
                           q=None if drafts.q is None else drafts.q[:, 0], start=start)
        batch.kv_len = top + batch.N + 1
        return self._launch_chain(live, arm, batch, None, span, top, bound(ctx.draws, live, advance=advance), ctx)

    def _launch_chain(self, live, arm, batch: DraftBatch, drafted: list[int] | None, span: Span, top: int, draws,
                      ctx) -> ChainLaunch:
        """One chain step's verify forward, verification and host transfer, launched (nothing waits for the
        device)."""
        logits, hiddens = self.runner.step(batch.tokens, batch.start,
                                           hidden_layers=self.speculation.aux_layers + self.verifier.hidden_layers,
                                           top=top)
        verdict = self.verifier.verify(logits, hiddens, batch, ctx.params, draws, None)
        emitted = self._emitted(verdict, batch)
        # a successor's draft counts are the device's (its budgets, a stop rule's verdicts): they come back with it
        layout, sent = self._send(logits, verdict, batch, ctx, live, emitted,
                                  () if drafted is not None else (batch.num_drafts,))
        # a learned drafter's features (and its next catch-up, after its own drafts) staged where the device has the
        # rows' positions, and its training law read now: the step's logits are the next replay's once it launches
        self.speculation.observe_verify(live, hiddens, None, verdict.accepted if batch.N else None, tokens=emitted,
                                        start=batch.start, top=top, logits=logits)
        launched = ChainLaunch(arm, batch, verdict, emitted, layout, sent, drafted, span, top, self.runner.fresh)
        self.speculation.settle()  # what drafters deferred from finishing samples, while the device runs the step
        return launched

    def _commit_chain(self, step: ChainLaunch, live: list[Sequence], ctx, since: float, appended) -> float:
        """Read a chain step (waiting for it), commit each unfinished row's tokens, record the step (its seconds:
        from `since`, the previous read); `appended`: the drafter that put this step's tokens on the device already
        (its successor was launched). Returns when the host had the step."""
        rows = step.sent.rows()
        read = time.perf_counter()
        going = [i for i, s in enumerate(live) if s.finish_reason is None]  # a row ended a step ago: dropped
        bad = step.layout.bad_rows(rows)
        if bad:
            self._check_finite([i for i in bad if i in going], live, ctx.steps, f"decode step {ctx.steps}")
        host = step.layout.read(rows)
        drafted = step.drafted if step.drafted is not None else step.layout.drafted(rows)
        self.speculation.observe_commit([live[i] for i in going], [host.accepted[i] for i in going], None)
        before = [len(s.completion_ids) for s in live]
        emitted = self._commit(live, host, True, ctx, going)
        if appended is not None:
            appended.appended([live[i] for i in going])
        self.proposer.after_commit(live, before, None, host.kept)
        ctx.finished = ctx.finished or len(going) < len(live)
        drafting = step.span.seconds()
        # the rows a step ago ended ran this step too (its cost), but drafted for nothing the loop would have run
        drafted, accepted = [drafted[i] for i in going], [host.accepted[i] for i in going]
        # a step that captured its graph first is no measure of its cost: its acceptance alone
        seconds = None if step.fresh else max(read - since - drafting, 0.0)
        self.speculation.observe_step(step.arm, len(live), seconds, None if step.fresh else drafting, drafted,
                                      accepted)
        self._metrics.record_verify(step.arm.drafter, drafted, accepted, step.drafted is None)
        self._metrics.batch_trace.append((read - ctx.t0, len(live), emitted, True))
        self._signal_idle(len(live) <= max(1, self.runner.cache.rows // 4))
        return read
