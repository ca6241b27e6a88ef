"""The ledger: what speculation costs and what it saves, kept once and read by everything that decides or reports.

One record, written once per decode step by `record` (the selector calls it from its `observe`):

    costs           (bucket, T) -> seconds of one target forward with T tokens per row (EMA 0.2), seeded by
                    calibration: the verify cost by token count; T = 1 is the plain step as the cost model sees it
    plain_settled   bucket -> seconds of a step decoded plainly, forward to commit (EMA 0.1: the slower view the
                    loss guard prices progress with)
    acceptance      drafter -> per-token acceptance (cost_model.AcceptanceTracker, evidence fading by 0.98 a verify)
    fresh           drafter -> (accepts, rejects) of its last ~2 uses (fading by 0.5: what a change detector reads)
    trials          drafter -> per-token trials measured, ever (a learned drafter's gate counts from a mark)
    draft_level     (drafter, bucket) -> seconds per draft level (EMA 0.2)
    saved, plain_time   S and P of the loss guard: seconds speculation saved (< 0: lost), and what plain decoding
                    would have taken for every step so far
    window          the same quantities summed since the metrics were last read (`take_window`): plain steps and
                    their seconds, S's change, and per drafter drafted, accepted, verifies, drafting seconds and
                    draft levels (each priced against the plain step at its live-batch bucket)

Views derived from it (`plain`, `plain_seconds`, `relative`, `draft_steps`, `loss_bound`) are the only ways the
selectors, the loss guard and the metrics price a step, so two readers cannot disagree on what a step cost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlspec.rollout.speculation.buckets import bucket, nearest_bucket
from rlspec.rollout.speculation.cost_model import ACCEPT_DECAY, EMA, AcceptanceTracker, CostModel, step_width
from rlspec.rollout.speculation.selectors.arms import expected_tokens, path_evidence
from rlspec.rollout.speculation.selectors.base import Arm

PLAIN_EMA = 0.1  # the settled plain step follows its last ~10 plain steps (context grows as a call runs)
FRESH_DECAY = 0.5  # the fresh view covers a drafter's last ~2 uses


class AcceptanceBook(dict):
    """drafter name -> AcceptanceTracker; an unknown drafter starts from the tracker's weak prior."""

    def __missing__(self, name: str) -> AcceptanceTracker:
        self[name] = AcceptanceTracker()
        return self[name]


@dataclass
class Window:
    """A drafter's verifies since a point in time (the metrics' last read, a health verdict)."""
    drafted: int = 0  # draft tokens offered
    accepted: int = 0  # of which accepted
    verifies: int = 0  # rows that carried a draft
    draft_s: float = 0.0  # seconds spent proposing
    timed_drafted: int = 0  # draft tokens of the steps whose seconds were measured (draft_s's)
    levels: int = 0  # draft levels run for the whole live batch (a step of depth d runs d)
    level_steps: float = 0.0  # those levels' seconds, each over the plain step at its live-batch bucket
    costed_levels: int = 0  # levels with a plain step to compare with

    def add(self, verifies: int, drafted: int, accepted: int, draft_s: float = 0.0, levels: int = 0,
            plain_s: float | None = None) -> None:
        self.verifies += verifies
        self.drafted += drafted
        self.accepted += accepted
        self.draft_s += draft_s
        self.levels += levels
        if levels:
            self.timed_drafted += drafted
        if plain_s:
            self.level_steps += draft_s / plain_s
            self.costed_levels += levels


@dataclass
class Ledger:
    costs: CostModel = field(default_factory=CostModel)
    plain_settled: dict = field(default_factory=dict)
    acceptance: AcceptanceBook = field(default_factory=AcceptanceBook)
    fresh: dict = field(default_factory=dict)
    trials: dict = field(default_factory=dict)
    draft_level: dict = field(default_factory=dict)
    saved: float = 0.0
    plain_time: float = 0.0
    # since the metrics' last read: [plain steps, their seconds], speculative steps, S when it began, drafter -> Window
    window_plain: list = field(default_factory=lambda: [0, 0.0])
    window_spec: int = 0
    window_saved_from: float = 0.0
    window_drafters: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.acceptance, AcceptanceBook):
            self.acceptance = AcceptanceBook(self.acceptance)

    # ---- the one writer ------------------------------------------------------------------------
    def record(self, arm: Arm, batch: int, seconds: float, draft_seconds: float, drafted: list[int],
               accepted: list[int], changed=None) -> None:
        """One decode step of `arm` over `batch` live rows: `seconds` forward to commit, `draft_seconds` proposing,
        per row the draft tokens offered and accepted. changed(drafter, accepts, rejects): the selector's change
        detector over the fresh view; True (it has reset the drafter's tracker) makes the fresh evidence all
        there is of the drafter. seconds None: a step whose time measures no cost (it captured its CUDA graph
        first): its drafts and their acceptance count, nothing of its time."""
        b = bucket(batch)
        if seconds is None:
            if arm.speculative:
                self._drafter(arm, b, None, drafted, accepted, changed)
            return
        spent = seconds + draft_seconds
        if arm.speculative:
            advanced = (sum(accepted) + len(accepted)) / max(len(accepted), 1)  # positions the rows moved on average
            plain = self.plain_seconds(b)
            if plain is None:  # nothing to compare with yet: the step counts as breaking even
                plain = spent / max(advanced, 1e-9)
            self.plain_time += advanced * plain
            self.saved += advanced * plain - spent
            self.window_spec += 1
            self._drafter(arm, b, draft_seconds, drafted, accepted, changed)
        else:
            old = self.plain_settled.get(b)
            self.plain_settled[b] = spent if old is None else old + PLAIN_EMA * (spent - old)
            self.plain_time += spent
        if not any(drafted):  # the metric's plain step: no row carried a draft (forward to commit)
            self.window_plain[0] += 1
            self.window_plain[1] += seconds
        self.costs.observe(batch, step_width(drafted), seconds)

    def _drafter(self, arm: Arm, b: int, draft_seconds: float, drafted: list[int], accepted: list[int],
                 changed) -> None:
        name = arm.drafter
        timed = () if draft_seconds is None else (draft_seconds, arm.depth, self.plain_seconds(b))
        if timed:
            key, level = (name, b), draft_seconds / arm.depth
            old = self.draft_level.get(key)
            self.draft_level[key] = level if old is None else (1 - EMA) * old + EMA * level
        busy = len(drafted) - drafted.count(0)  # rows that carried a draft (a row without one accepted none)
        if busy:
            window = self.window_drafters.get(name)
            if window is None:
                window = self.window_drafters[name] = Window()
            window.add(busy, sum(drafted), sum(accepted), *timed)
        acc, rej = path_evidence(arm, drafted, accepted)
        self.trials[name] = self.trials.get(name, 0.0) + acc + rej
        fa, fr = self.fresh.get(name, (0.0, 0.0))
        fa, fr = FRESH_DECAY * fa + acc, FRESH_DECAY * fr + rej
        self.fresh[name] = (fa, fr)
        if changed is not None and changed(name, fa, fr):
            acc, rej = fa, fr  # the recent evidence is all there is of the new drafter
        tr = self.acceptance[name]
        tr.accepts = tr.accepts * ACCEPT_DECAY + acc
        tr.rejects = tr.rejects * ACCEPT_DECAY + rej
        share = busy / max(len(drafted), 1)
        tr.drafted_share = (1 - EMA) * tr.drafted_share + EMA * share

    def forget(self, drafter: str) -> None:
        """The drafter changed: its recent evidence no longer tells about it."""
        self.fresh.pop(drafter, None)

    # ---- views ---------------------------------------------------------------------------------
    def plain(self, b: int) -> float | None:
        """Bucket b's plain step as the cost model has it (calibrated, then EMA 0.2 of steps one token wide)."""
        return self.costs.cost(b, 1)

    def plain_seconds(self, b: int) -> float | None:
        """Bucket b's plain step as measured on plain steps (EMA 0.1), else the cost model's, else the nearest
        bucket's measured one (None before any)."""
        settled = self.plain_settled.get(b)
        if settled is None:
            settled = self.costs.cost(b, 1)
        if settled is None and self.plain_settled:
            settled = self.plain_settled[nearest_bucket(self.plain_settled, b)]
        return settled

    def relative(self, b: int, T: int) -> float:
        """cost(b, T) / cost(b, 1): a verify of T tokens per row in plain steps. A bucket without a verify measured
        borrows the nearest one that has one; with none at all (plain steps only) verifying counts as free, so that
        arms get tried. Never below 1: a verify is that forward and more (it reads lower when plain steps were
        measured with their overheads and the verify sizes only calibrated)."""
        verified = {bb for bb, t in self.costs.table if t > 1}
        if not verified:
            return 1.0
        rel = self.costs.relative(b if b in verified else nearest_bucket(verified, b), T) or 1.0
        return max(rel, 1.0)

    def draft_steps(self, drafter: str, b: int) -> float:
        """One draft level of `drafter` in plain steps of bucket b. A bucket it has not drafted in borrows the
        nearest measured bucket's seconds per level (taking it as free made a new bucket's first guess
        optimistic); a drafter never measured anywhere counts as free, so that it gets tried."""
        plain = self.plain(b)
        if not plain:
            return 0.0
        level = self.draft_level.get((drafter, b))
        if level is None:
            seen = [bb for d, bb in self.draft_level if d == drafter]
            if not seen:
                return 0.0
            level = self.draft_level[(drafter, nearest_bucket(seen, b))]
        return level / plain

    def steps_per_verify(self, arm: Arm, b: int) -> float:
        """A verify of `arm`, drafting included, in plain steps of bucket b."""
        return self.relative(b, 1 + arm.nodes) + self.draft_steps(arm.drafter, b) * arm.depth

    def loss_bound(self, arm: Arm, b: int) -> float:
        """Seconds a step of `arm` in bucket b loses against plain decoding if its drafter's acceptance is at the
        low end of its evidence (mean - 2 standard deviations of the per-token rate); negative when even that
        gains; inf before any plain-step figure. A drafter known only by its prior is bounded at acceptance 0."""
        plain = self.plain_seconds(b)
        if plain is None:
            return float("inf")
        tr = self.acceptance[arm.drafter]
        rate = tr.rate
        trials = tr.accepts + tr.rejects + tr.prior_accepts + tr.prior_rejects
        low = max(0.0, rate - 2.0 * math.sqrt(rate * (1.0 - rate) / trials))
        return (self.steps_per_verify(arm, b) - expected_tokens(arm, tr, low)) * plain

    # ---- reading the window ---------------------------------------------------------------------
    def take_window(self) -> dict:
        """The window's figures, then a new window: plain_steps, plain_s, saved_s (None without speculative steps),
        drafters (name -> Window)."""
        steps, secs = self.window_plain
        out = {"plain_steps": steps, "plain_s": secs, "drafters": self.window_drafters,
               "saved_s": self.saved - self.window_saved_from if self.window_spec else None}
        self.window_plain, self.window_spec, self.window_saved_from, self.window_drafters = [0, 0.0], 0, self.saved, {}
        return out

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The record as plain values (dicts as lists of pairs, in insertion order); the metrics window is not
        carried over."""
        return {"costs": self.costs.state_dict(),
                "plain_settled": [[b, s] for b, s in self.plain_settled.items()],
                "acceptance": [[name, tr.state_dict()] for name, tr in self.acceptance.items()],
                "fresh": [[d, acc, rej] for d, (acc, rej) in self.fresh.items()],
                "trials": [[d, n] for d, n in self.trials.items()],
                "draft_level": [[d, b, s] for (d, b), s in self.draft_level.items()],
                "saved": self.saved, "plain_time": self.plain_time}

    def load_state_dict(self, state: dict) -> None:
        self.costs.load_state_dict(state["costs"])
        self.plain_settled = {int(b): float(s) for b, s in state["plain_settled"]}
        self.acceptance = AcceptanceBook()
        for name, tr in state["acceptance"]:
            self.acceptance[name] = AcceptanceTracker()
            self.acceptance[name].load_state_dict(tr)
        self.fresh = {d: (float(acc), float(rej)) for d, acc, rej in state["fresh"]}
        self.trials = {d: float(n) for d, n in state["trials"]}
        self.draft_level = {(d, int(b)): float(s) for d, b, s in state["draft_level"]}
        self.saved, self.plain_time = float(state["saved"]), float(state["plain_time"])
        self.window_saved_from = self.saved


def legacy_ledger_state(state: dict) -> dict:
    """A ledger state from a selector state saved before the ledger existed (its costs, acceptance, drafting
    costs and change-detector evidence, and the loss guard's figures, kept apart)."""
    guard = state.get("guard") or {}
    acceptance = state.get("acceptance", [])
    if isinstance(acceptance, dict):  # the fixed selector kept one tracker
        acceptance = [[state["shape"][0], acceptance]]
    return {"costs": state["costs"], "plain_settled": guard.get("plain_step", []), "acceptance": acceptance,
            "fresh": state.get("fresh", []), "trials": [], "draft_level": state.get("draft_level", []),
            "saved": guard.get("saved", 0.0), "plain_time": guard.get("plain_time", 0.0)}
