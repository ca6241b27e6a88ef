"""LossGuard: speculation may never cost a run more than a small share of its decode time.

The adaptive selector chooses from a model (expected tokens over predicted cost) that misses what it cannot see
(a probe's catch-up, per-step bookkeeping, a context longer than calibration's), and exploring costs steps by
design; over a short run, or a workload where nothing pays, those losses add up. The guard is the constraint of
a conservative bandit (Wu et al., "Conservative Bandits", 2016): with the baseline arm (plain decoding) known to
be safe, a risky choice is made only while the run's realized reward stays above (1 - alpha) of the baseline's,
even if it loses everything.

Measured, not modelled, and read from the ledger (ledger.py), which keeps
    P = the seconds plain decoding would have taken for every decode step so far (`Ledger.plain_time`), and
    S = the seconds speculation saved (`Ledger.saved`; negative: lost).
A speculative arm plays only if S - max(L, 0) >= -alpha P, L being what the step loses if its drafter's acceptance
is at the low end of its evidence (`Ledger.loss_bound`). So S never falls more than one step's misprediction below
-alpha P, and once it is below, nothing speculates until plain steps have raised the floor: the run decodes at
>= ~(1 - alpha) of plain decoding's speed whatever the drafters and the cost model do. The decision pipeline
(decide.py) holds a speculative pick the guard refuses and names the guard as the step's reason.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossGuard:
    alpha: float = 0.02  # most share of plain decoding's time speculation may lose over a run
    held: int = 0  # speculative picks turned into plain steps

    def allows(self, ledger, loss_s: float) -> bool:
        """Whether a speculative step that may lose `loss_s` seconds (its bound) keeps S >= -alpha P."""
        if self.alpha == float("inf"):  # no floor (inf x 0 would read as nan)
            return True
        return ledger.saved - max(loss_s, 0.0) >= -self.alpha * ledger.plain_time

    def admits(self, ledger, arm, b: int) -> bool:
        """Whether `arm` may play in bucket b: plain decoding always, a speculative arm within the floor."""
        return not arm.speculative or self.allows(ledger, ledger.loss_bound(arm, b))

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "held": self.held}

    def load_state_dict(self, state: dict) -> None:
        self.alpha, self.held = float(state["alpha"]), int(state["held"])
