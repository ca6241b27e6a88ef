"""The forced selector ("always"): the configured arm on every step, whatever it costs.

For benchmarks and tests that must measure or exercise one speculation shape (acceptance per
position, the sampled law of trees) without a cost model switching it off. Its costs are still
measured so metrics stay comparable.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlspec.rollout.speculation.cost_model import CostModel, step_width
from rlspec.rollout.speculation.selectors.base import SELECTORS, Arm, arm_key, check_selector_state


@dataclass
class ForcedSelector:
    arm: Arm
    costs: CostModel = field(default_factory=CostModel)

    @property
    def max_nodes(self) -> int:
        return self.arm.nodes

    def verify_sizes(self) -> list[int]:
        return []  # it never consults the cost model, so nothing to calibrate

    def choose(self, batch: int) -> Arm:
        return self.arm

    def observe(self, arm: Arm, batch: int, seconds: float, draft_seconds: float,
                drafted: list[int], accepted: list[int]) -> None:
        self.costs.observe(batch, step_width(drafted), seconds)

    def reset_acceptance(self, drafter: str, keep: float = 0.0) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {"strategy/forced": 1.0}

    def state_dict(self) -> dict:
        return {"kind": "always", "shape": list(arm_key(self.arm)), "costs": self.costs.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_selector_state(state, "always", arm_key(self.arm), "the arm")
        self.costs.load_state_dict(state["costs"])


@SELECTORS.register("always")
def _always(spec, drafters: list[str], learned: tuple[str, ...]) -> ForcedSelector:
    """The configured drafter (the first of the set), num_draft_tokens deep, tree_width wide."""
    return ForcedSelector(Arm(drafters[0], spec.num_draft_tokens, spec.tree_width))
