"""Whether a learned drafter may be an arm at all: evidence first, then a prior gain above 1.

A learned drafter built with random weights is accepted about never, yet the selectors' acceptance
prior (a = 0.5) makes its trees look like 2-3x wins, so a bandit spends steps finding out, and a
32-sequence GRPO-shaped call with an untrained drafter in `auto` ran at 0.35x of plain decoding.
The gate keeps such a drafter out of the arm set until something says it can pay:

- the online trainer's estimate of its per-token acceptance (`DrafterTrainer.acceptance_estimate`:
  sum_x min(p(x), q(x)) on buffered rollouts, no verify spent on it), handed in by `admit(rate)`;
  it also becomes the drafter tracker's prior (`ESTIMATE_WEIGHT` trials at that rate);
- weights from elsewhere (`SpecConfig.drafter_path`, the warm-start cache; `admit(None)`): trusted,
  judged by the selector's usual prior as before;
- the engine's own measurements once it plays: after `GATE_TRIALS` measured per-token trials since
  the last estimate (the ledger's count of the drafter's trials, less its count at the estimate), the
  tracker's rate (mostly measured by then) decides, so the gate closes again when measured acceptance falls.

With evidence, the gate is open while the drafter's best prior gain over the calibrated buckets
exceeds 1 + GATE_MARGIN (computed by the selector: `best_gain(rate)`); a drafter with no evidence
is never open. Re-checked on new evidence and every RECHECK_EVERY selector steps (costs drift),
not per step: the check evaluates every arm of the drafter at every calibrated bucket.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rlspec.rollout.speculation.cost_model import AcceptanceTracker

GATE_MARGIN = 0.05  # as the fixed selector's hysteresis: break-even is no reason to draft
GATE_TRIALS = 16.0  # measured per-token trials after which the engine's acceptance decides
ESTIMATE_WEIGHT = 4.0  # the trainer's estimate counts as this many trials in the tracker's prior
RECHECK_EVERY = 16  # selector steps between re-checks without new evidence


@dataclass
class LearnedGate:
    trusted: bool = False  # weights from a trained directory or the warm-start cache
    estimate: float | None = None  # the trainer's estimated per-token acceptance of the current weights
    open: bool = False
    checked_at: int = -RECHECK_EVERY  # selector step of the latest check
    mark: float = 0.0  # the drafter's measured trials (the ledger's) when the latest estimate came
    # the drafter's per-token trials measured so far: Ledger.trials, bound by the selector (bind)
    trials: Callable[[], float] = field(default=lambda: 0.0, repr=False, compare=False)
    _by_measure: bool = field(default=False, repr=False)  # measurements decided the latest check

    def bind(self, ledger, drafter: str) -> "LearnedGate":
        """Count the measured trials from `ledger`'s record of `drafter`."""
        self.trials = lambda: ledger.trials.get(drafter, 0.0)
        self.mark = self.trials()
        return self

    @property
    def measured(self) -> float:
        """Per-token trials the engine measured since the latest estimate."""
        return self.trials() - self.mark

    @property
    def has_evidence(self) -> bool:
        return self.trusted or self.estimate is not None or self.measured >= GATE_TRIALS

    def admit(self, rate: float | None, tracker: AcceptanceTracker | None = None) -> None:
        """New weights judged by the trainer (rate), or weights from elsewhere (None: trusted); the
        drafter's `tracker` takes the prior that evidence gives (acceptance_tracker)."""
        if rate is None:
            self.trusted, self.estimate = True, None
        else:
            self.estimate = min(max(float(rate), 0.0), 1.0)
        self.mark = self.trials()
        self.checked_at = -RECHECK_EVERY  # check at the next step
        if tracker is not None:
            fresh = acceptance_tracker(self)
            tracker.prior_accepts, tracker.prior_rejects = fresh.prior_accepts, fresh.prior_rejects

    def check(self, step: int, best_gain: Callable[[], float]) -> bool:
        """Re-decide when due (every RECHECK_EVERY steps, and at once when measurements take over);
        best_gain(): the drafter's highest prior gain over the calibrated buckets."""
        by_measure = self.measured >= GATE_TRIALS
        if step - self.checked_at < RECHECK_EVERY and by_measure == self._by_measure:
            return self.open
        self.checked_at, self._by_measure = step, by_measure
        if not self.has_evidence:
            self.open = False
        elif self.trusted and self.estimate is None and not by_measure:
            self.open = True  # a trained drafter: the selector's own prior and probes judge it, as before
        else:
            self.open = best_gain() > 1 + GATE_MARGIN
        return self.open

    def prior(self) -> tuple[float, float] | None:
        """(prior accepts, prior rejects) for the drafter's acceptance tracker, from the estimate."""
        if self.estimate is None:
            return None
        return ESTIMATE_WEIGHT * self.estimate, ESTIMATE_WEIGHT * (1 - self.estimate)

    def state_dict(self) -> dict:
        return {"trusted": self.trusted, "estimate": self.estimate, "measured": self.measured, "open": self.open,
                "checked_at": self.checked_at}

    def load_state_dict(self, state: dict) -> None:
        """Restore after the ledger it is bound to (the measured count is kept as an offset from its trials)."""
        self.trusted, self.open = bool(state["trusted"]), bool(state["open"])
        self.estimate = None if state["estimate"] is None else float(state["estimate"])
        self.mark, self.checked_at = self.trials() - float(state["measured"]), int(state["checked_at"])
        self._by_measure = self.measured >= GATE_TRIALS


def acceptance_tracker(gate: LearnedGate | None) -> AcceptanceTracker:
    """A fresh tracker for a drafter: its prior the trainer's estimate when its gate has one, else the
    tracker's usual a = 0.5."""
    prior = gate.prior() if gate is not None else None
    return AcceptanceTracker(*prior) if prior else AcceptanceTracker()


def make_gates(learned: tuple[str, ...], trusted: bool) -> dict[str, LearnedGate]:
    """One gate per learned drafter; trusted when its weights came from a trained directory."""
    return {name: LearnedGate(trusted=trusted) for name in learned}
