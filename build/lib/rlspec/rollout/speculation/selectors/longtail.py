"""The long-tail selector ("fixed"): the configured drafter and shape, on where measured costs say it pays.

The
long-tail selector speculates where the measured costs say it pays: it compares, for every depth,
the expected tokens per verify (from the tracked acceptance rate) with the measured cost of a
verify of that size relative to one plain decode step at the same live batch (plus the drafting
time). Verification is cheap relative to decode at small batches and dear at large ones, so the
chosen depth grows as the batch shrinks into its tail, with no batch threshold written down.
A learned drafter speculates only while its gate is open (selectors/gate.py); `metrics` reports the
call's regret against the best fixed depth or OFF (selectors/regret.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlspec.rollout.speculation.cost_model import AcceptanceTracker, CostModel, bucket, nearest_bucket, step_width
from rlspec.rollout.speculation.selectors.base import OFF, Arm, SELECTORS, check_selector_state
from rlspec.rollout.speculation.selectors.gate import LearnedGate, acceptance_tracker
from rlspec.rollout.speculation.selectors.regret import RegretLedger

HYSTERESIS = 0.05  # speculation turns on above 1.05x estimated gain, off below 0.95x


@dataclass
class LongTailSelector:
    drafter: str
    max_depth: int
    width: int = 1
    max_spec_batch: int | None = None  # a user override: never speculate above this live batch
    costs: CostModel = field(default_factory=CostModel)
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    draft_seconds: dict = field(default_factory=dict)  # batch bucket -> EMA seconds of one draft level, whole batch
    on: bool = False
    last_gain: float = 0.0
    gate: LearnedGate | None = None  # set when the drafter is learned: no speculation without evidence
    ledger: RegretLedger = field(default_factory=RegretLedger)
    steps: int = 0

    def depths(self) -> list[int]:
        ds, d = [], 1
        while d < self.max_depth:
            ds.append(d)
            d *= 2
        return ds + [self.max_depth]

    def verify_sizes(self) -> list[int]:
        """Every T (tokens per row in one forward) the cost model should be calibrated at."""
        return [1] + [1 + d * self.width for d in self.depths()]

    @property
    def max_nodes(self) -> int:
        return self.max_depth * self.width

    def reset_acceptance(self, drafter: str, keep: float = 0.0) -> None:
        """The drafter's weights changed: its acceptance evidence belongs (mostly) to the old weights."""
        if keep > 0:
            self.acceptance.fade(keep)
        else:
            self.acceptance = acceptance_tracker(self.gate)

    def admit(self, drafter: str, rate: float | None = None) -> None:
        """Evidence for the learned drafter's gate (AdaptiveSelector.admit)."""
        if self.gate is None or drafter != self.drafter:
            return
        self.gate.admit(rate, self.acceptance)

    def begin_call(self) -> None:
        self.ledger.clear()

    def metrics(self) -> dict[str, float]:
        out = {"strategy/spec_on": float(self.on), "strategy/expected_speedup": self.last_gain,
               "strategy/accept_rate": self.acceptance.rate}
        if self.gate is not None:
            out[f"strategy/gate/{self.drafter}"] = float(self.gate.open)
        arms = [OFF] + ([Arm(self.drafter, d, self.width) for d in self.depths()]
                        if self.gate is None or self.gate.open else [])
        regret = self.ledger.regret(arms, lambda b: self.costs.cost(b, 1),
                                    lambda a, b: self.gain(b, a.depth) if a.speculative else 1.0)
        if regret is not None:
            out["strategy/regret"] = regret[0]
            out["strategy/best_fixed_depth"] = float(regret[1].depth)
        return out

    def state_dict(self) -> dict:
        return {"kind": "fixed", "shape": [self.drafter, self.max_depth, self.width], "costs": self.costs.state_dict(),
                "acceptance": self.acceptance.state_dict(),
                "draft_seconds": [[b, s] for b, s in self.draft_seconds.items()], "draft_per": "level", "on": self.on,
                "last_gain": self.last_gain, "steps": self.steps,
                "gate": None if self.gate is None else self.gate.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_selector_state(state, "fixed", [self.drafter, self.max_depth, self.width], "(drafter, depth, width)")
        self.costs.load_state_dict(state["costs"])
        self.acceptance.load_state_dict(state["acceptance"])
        # states saved before this held seconds per propose (of max_depth levels, mostly): per level now
        per = 1.0 if state.get("draft_per") == "level" else float(self.max_depth)
        self.draft_seconds = {int(b): float(s) / per for b, s in state["draft_seconds"]}
        self.on, self.last_gain = bool(state["on"]), float(state["last_gain"])
        self.steps = int(state.get("steps", 0))  # absent in states saved before the gate existed
        if self.gate is not None and state.get("gate") is not None:
            self.gate.load_state_dict(state["gate"])

    def gain(self, batch: int, depth: int) -> float:
        """Estimated tokens per second with `depth` drafts over tokens per second without."""
        arm = Arm(self.drafter, depth, self.width)
        rel = self.costs.relative(batch, 1 + arm.nodes)
        plain = self.costs.cost(batch, 1)
        if rel is None or not plain:
            return 0.0
        draft = self._draft_cost(bucket(batch)) * depth / plain  # `depth` levels for the whole batch
        # the tracked rate is per level of this shape: a chain token, or any of `width` siblings
        return self.acceptance.expected_tokens(depth) / (rel + draft)

    def _draft_cost(self, b: int) -> float:
        """Seconds of one draft level in bucket b; a bucket not drafted in yet borrows the nearest measured one
        (as the bandit does): taking it as free made unmeasured buckets look like wins, and kept a
        learned drafter's gate open on them after its measured acceptance had fallen."""
        if b in self.draft_seconds or not self.draft_seconds:
            return self.draft_seconds.get(b, 0.0)
        return self.draft_seconds[nearest_bucket(self.draft_seconds, b)]

    def choose(self, batch: int) -> Arm:
        self.steps += 1
        if self.max_spec_batch is not None and batch > self.max_spec_batch or not self._gate_open():
            self.on = False
            return OFF
        best_depth, best = max(((d, self.gain(batch, d)) for d in self.depths()), key=lambda x: x[1])
        self.last_gain = best
        self.on = best > (1 - HYSTERESIS if self.on else 1 + HYSTERESIS)
        return Arm(self.drafter, best_depth, self.width) if self.on else OFF

    def observe(self, arm: Arm, batch: int, seconds: float, draft_seconds: float,
                drafted: list[int], accepted: list[int]) -> None:
        self.costs.observe(batch, step_width(drafted), seconds)
        if arm.speculative:
            key = bucket(batch)
            old, level = self.draft_seconds.get(key), draft_seconds / max(arm.depth, 1)
            self.draft_seconds[key] = level if old is None else 0.8 * old + 0.2 * level
            # evidence per level: a tree of n nodes offers n // width levels, each passed or not
            levels = [n if self.width == 1 else max(1, n // self.width) for n in drafted]
            self.acceptance.observe(levels, accepted)
            if self.gate is not None:
                self.gate.observed(sum(a + (a < n) for n, a in zip(levels, accepted) if n > 0))
        self.ledger.record(bucket(batch), batch, sum(a + 1 for a in accepted), seconds + draft_seconds)

    def _gate_open(self) -> bool:
        """No gate (a model-free drafter), or the learned drafter's gate is open: its best gain over the
        calibrated buckets (bucket 1 when none is) exceeds 1.05 on evidence."""
        if self.gate is None:
            return True
        known = self.costs.measured_buckets() or [1]
        return self.gate.check(self.steps, lambda: max(self.gain(b, d) for b in known for d in self.depths()))



@SELECTORS.register("fixed")
def _fixed(spec, drafters: list[str], learned: tuple[str, ...]) -> LongTailSelector:
    """The configured drafter (the first of the set) and shape, deeper as the batch shrinks."""
    gate = LearnedGate(trusted=bool(spec.drafter_path)) if drafters[0] in learned else None
    return LongTailSelector(drafters[0], spec.num_draft_tokens, spec.tree_width, spec.max_spec_batch, gate=gate)
