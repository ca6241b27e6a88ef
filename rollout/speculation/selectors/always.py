"""The always selector ("always"): the configured arm on every step, whatever it costs.

For benchmarks and tests that must measure or exercise one speculation shape (acceptance per position, the
sampled law of trees) without a cost model switching it off. Its arm is the decision pipeline's forced arm
(decide.py: the "forced" stage, as `Speculation.force`); its costs are still recorded in the ledger so metrics
stay comparable.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlspec.rollout.speculation.cost_model import CostModel
from rlspec.rollout.speculation.ledger import Ledger, legacy_ledger_state
from rlspec.rollout.speculation.selectors.base import SELECTORS, Arm, arm_key, check_selector_state


@dataclass
class AlwaysSelector:
    arm: Arm
    ledger: Ledger = field(default_factory=Ledger)

    @property
    def costs(self) -> CostModel:
        return self.ledger.costs

    @property
    def forced(self) -> Arm:
        """The arm the decision pipeline plays on every step."""
        return self.arm

    @property
    def max_nodes(self) -> int:
        return self.arm.nodes

    def verify_sizes(self) -> list[int]:
        return []  # it never consults the cost model, so nothing to calibrate

    def choose(self, batch: int) -> Arm:
        return self.arm

    def observe(self, arm: Arm, batch: int, seconds: float, draft_seconds: float,
                drafted: list[int], accepted: list[int]) -> None:
        self.ledger.record(arm, batch, seconds, draft_seconds, drafted, accepted)

    def reset_acceptance(self, drafter: str, keep: float = 0.0) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {"strategy/forced": 1.0}

    def state_dict(self) -> dict:
        return {"kind": "always", "shape": list(arm_key(self.arm)), "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_selector_state(state, "always", arm_key(self.arm), "the arm")
        self.ledger.load_state_dict(state["ledger"] if "ledger" in state else legacy_ledger_state(state))


@SELECTORS.register("always")
def _always(spec, drafters: list[str], learned: tuple[str, ...]) -> AlwaysSelector:
    """The configured drafter (the first of the set), num_draft_tokens deep, tree_width wide."""
    return AlwaysSelector(Arm(drafters[0], spec.num_draft_tokens, spec.tree_width))
