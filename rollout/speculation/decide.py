"""Why a decode step speculates: the one place that decides, stage by stage.

Each step `Decision.decide(selector, batch)` returns the arm and names the stage that settled it. The stages, in
order; the first that settles the step is its reason, counted as the metric strategy/reason/<reason>:

    off             no drafter is configured: plain decoding
    health          drafter health turned speculation off (a backend pushing drafters to workers: drafter_health.py):
                    a drafter that failed its checks never drafts, not even under a forced arm
    forced          an arm set by Speculation.force (tests, benchmarks, warm start's plain collection) or the
                    "always" selector's arm: played whatever it costs
    max_spec_batch  more rows live than SpecConfig.max_spec_batch: plain decoding
    --              the selector picks an arm (it sees every step the stages above let through: its clock)
    guard           the pick is speculative and could take the run's savings below the loss guard's floor
                    (selectors/loss_guard.py): plain decoding, and the guard's `held` counts it
    gate            the pick is plain because the learned drafters' gates leave no speculative arm
                    (selectors/gate.py)
    selector        the selector's own pick: speculative where its estimate says drafting pays (fixed: the gain
                    with hysteresis; adaptive: the bandit's estimate or an exploration), plain where none does

The selector reads its figures from the ledger (ledger.py); the reason counts are this object's and restart each
time the metrics are read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlspec.rollout.speculation.buckets import bucket
from rlspec.rollout.speculation.selectors.base import OFF, Arm

REASONS = ("off", "health", "forced", "max_spec_batch", "guard", "gate", "selector")


@dataclass
class Decision:
    forced: Arm | None = None  # Speculation.force's arm
    speculating: bool = True  # False: no drafter is configured
    healthy: bool = True  # drafter health's verdict (Speculation.set_healthy)
    max_spec_batch: int | None = None  # SpecConfig.max_spec_batch
    reason: str = "selector"  # the latest step's
    counts: dict = field(default_factory=dict)  # reason -> steps since the metrics were last read

    def decide(self, selector, batch: int) -> Arm:
        arm, self.reason = self._decide(selector, batch)
        self.counts[self.reason] = self.counts.get(self.reason, 0) + 1
        return arm

    def _decide(self, selector, batch: int) -> tuple[Arm, str]:
        if not self.speculating:
            return OFF, "off"
        if not self.healthy:  # before a forced arm: a drafter that fails its checks never drafts
            return OFF, "health"
        forced = self.forced if self.forced is not None else getattr(selector, "forced", None)
        if forced is not None:
            return forced, "forced"
        if self.max_spec_batch is not None and batch > self.max_spec_batch:
            return OFF, "max_spec_batch"
        pick = selector.choose(batch)
        guard = getattr(selector, "guard", None)
        if pick.speculative and guard is not None and not guard.admits(selector.ledger, pick, bucket(batch)):
            guard.held += 1
            overruled = getattr(selector, "overruled", None)
            if overruled is not None:
                overruled(OFF)
            return OFF, "guard"
        if not pick.speculative and getattr(selector, "gated", _never)():
            return OFF, "gate"
        return pick, "selector"

    def metrics(self) -> dict[str, float]:
        """strategy/reason/<reason>: steps each stage settled since the last read."""
        out = {f"strategy/reason/{r}": float(n) for r, n in self.counts.items()}
        self.counts = {}
        return out


def _never() -> bool:
    return False
