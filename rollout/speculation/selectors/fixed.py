"""The fixed selector ("fixed"): the configured drafter and shape, on where measured costs say it pays.

For every depth 1, 2, 4, ... max_depth it compares the expected tokens per verify (from the drafter's per-token
acceptance, a tree's width lifting each level) with the cost of a verify of that size relative to one plain step
at the same live batch, plus the drafting, all read from the ledger (ledger.py). Verification is cheap relative to
decode at small batches and dear at large ones, so the chosen depth grows as the batch shrinks into its tail, with
no batch threshold written down. A learned drafter speculates only while its gate is open (selectors/gate.py);
`metrics` reports the call's regret against the best fixed depth or OFF (selectors/regret.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlspec.rollout.speculation.buckets import bucket
from rlspec.rollout.speculation.cost_model import AcceptanceTracker, CostModel
from rlspec.rollout.speculation.ledger import Ledger, legacy_ledger_state
from rlspec.rollout.speculation.selectors.arms import expected_tokens
from rlspec.rollout.speculation.selectors.base import OFF, Arm, SELECTORS, check_selector_state
from rlspec.rollout.speculation.selectors.gate import LearnedGate, acceptance_tracker
from rlspec.rollout.speculation.selectors.regret import RegretLedger

HYSTERESIS = 0.05  # speculation turns on above 1.05x estimated gain, off below 0.95x


@dataclass
class FixedSelector:
    drafter: str
    max_depth: int
    width: int = 1
    ledger: Ledger = field(default_factory=Ledger)  # costs, acceptance, drafting (ledger.py)
    on: bool = False
    last_gain: float = 0.0
    gate: LearnedGate | None = None  # set when the drafter is learned: no speculation without evidence
    regret: RegretLedger = field(default_factory=RegretLedger)
    steps: int = 0

    def __post_init__(self) -> None:
        if self.gate is not None:
            self.gate.bind(self.ledger, self.drafter)

    @property
    def costs(self) -> CostModel:
        return self.ledger.costs

    @costs.setter
    def costs(self, costs: CostModel) -> None:
        self.ledger.costs = costs

    @property
    def acceptance(self) -> AcceptanceTracker:
        """The drafter's per-token acceptance (the ledger's)."""
        return self.ledger.acceptance[self.drafter]

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
            self.ledger.acceptance[self.drafter] = acceptance_tracker(self.gate)
            self.ledger.forget(self.drafter)

    def admit(self, drafter: str, rate: float | None = None) -> None:
        """Evidence for the learned drafter's gate (AdaptiveSelector.admit)."""
        if self.gate is None or drafter != self.drafter:
            return
        self.gate.admit(rate, self.acceptance)

    def begin_call(self) -> None:
        self.regret.clear()

    def metrics(self) -> dict[str, float]:
        out = {"strategy/spec_on": float(self.on), "strategy/expected_speedup": self.last_gain,
               "strategy/accept_rate": self.acceptance.rate}
        if self.gate is not None:
            out[f"strategy/gate/{self.drafter}"] = float(self.gate.open)
        arms = [OFF] + ([Arm(self.drafter, d, self.width) for d in self.depths()]
                        if self.gate is None or self.gate.open else [])
        regret = self.regret.regret(arms, self.ledger.plain,
                                    lambda a, b: self.gain(b, a.depth) if a.speculative else 1.0)
        if regret is not None:
            out["strategy/regret"] = regret[0]
            out["strategy/best_fixed_depth"] = float(regret[1].depth)
        return out

    def state_dict(self) -> dict:
        return {"kind": "fixed", "shape": [self.drafter, self.max_depth, self.width],
                "ledger": self.ledger.state_dict(), "on": self.on,
                "last_gain": self.last_gain, "steps": self.steps,
                "gate": None if self.gate is None else self.gate.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_selector_state(state, "fixed", [self.drafter, self.max_depth, self.width], "(drafter, depth, width)")
        self.ledger.load_state_dict(state["ledger"] if "ledger" in state else legacy_ledger_state(state))
        self.on, self.last_gain = bool(state["on"]), float(state["last_gain"])
        self.steps = int(state.get("steps", 0))  # absent in states saved before the gate existed
        if self.gate is not None and state.get("gate") is not None:
            self.gate.load_state_dict(state["gate"])

    def gain(self, batch: int, depth: int) -> float:
        """Estimated tokens per second with `depth` drafts over tokens per second without."""
        arm = Arm(self.drafter, depth, self.width)
        rel = self.costs.relative(batch, 1 + arm.nodes)
        if rel is None:  # no cost measured in this bucket: no case for drafting
            return 0.0
        # drafting: the ledger's seconds per level (a bucket not drafted in borrows the nearest measured one)
        draft = self.ledger.draft_steps(self.drafter, bucket(batch)) * depth
        return expected_tokens(arm, self.acceptance) / (rel + draft)

    def choose(self, batch: int) -> Arm:
        self.steps += 1
        if not self._gate_open():
            self.on = False
            return OFF
        best_depth, best = max(((d, self.gain(batch, d)) for d in self.depths()), key=lambda x: x[1])
        self.last_gain = best
        self.on = best > (1 - HYSTERESIS if self.on else 1 + HYSTERESIS)
        return Arm(self.drafter, best_depth, self.width) if self.on else OFF

    def observe(self, arm: Arm, batch: int, seconds: float, draft_seconds: float,
                drafted: list[int], accepted: list[int]) -> None:
        if seconds is not None:
            self.regret.record(bucket(batch), batch, sum(a + 1 for a in accepted), seconds + draft_seconds)
        self.ledger.record(arm, batch, seconds, draft_seconds, drafted, accepted)

    def gated(self) -> bool:
        """Whether the learned drafter's gate is closed (the decision pipeline's reason for a plain step)."""
        return self.gate is not None and not self.gate.open

    def _gate_open(self) -> bool:
        """No gate (a model-free drafter), or the learned drafter's gate is open: its best gain over the
        calibrated buckets (bucket 1 when none is) exceeds 1.05 on evidence."""
        if self.gate is None:
            return True
        known = self.costs.measured_buckets() or [1]
        return self.gate.check(self.steps, lambda: max(self.gain(b, d) for b in known for d in self.depths()))



@SELECTORS.register("fixed")
def _fixed(spec, drafters: list[str], learned: tuple[str, ...]) -> FixedSelector:
    """The configured drafter (the first of the set) and shape, deeper as the batch shrinks."""
    gate = LearnedGate(trusted=bool(spec.drafter_path)) if drafters[0] in learned else None
    return FixedSelector(drafters[0], spec.num_draft_tokens, spec.tree_width, gate=gate)
