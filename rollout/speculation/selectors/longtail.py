"""The long-tail selector ("fixed"): the configured drafter and shape, on where measured costs say it pays.

The
long-tail selector speculates where the measured costs say it pays: it compares, for every depth,
the expected tokens per verify (from the tracked acceptance rate) with the measured cost of a
verify of that size relative to one plain decode step at the same live batch (plus the drafting
time). Verification is cheap relative to decode at small batches and dear at large ones, so the
chosen depth grows as the batch shrinks into its tail, with no batch threshold written down.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout.speculation.cost_model import AcceptanceTracker, CostModel, bucket
from rollout.speculation.selectors.base import OFF, Arm, SELECTORS, check_selector_state

HYSTERESIS = 0.05  # speculation turns on above 1.05x estimated gain, off below 0.95x


@dataclass
class LongTailSelector:
    drafter: str
    max_depth: int
    width: int = 1
    max_spec_batch: int | None = None  # a user override: never speculate above this live batch
    costs: CostModel = field(default_factory=CostModel)
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    draft_seconds: dict = field(default_factory=dict)  # batch bucket -> EMA seconds per propose
    on: bool = False
    last_gain: float = 0.0

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
            self.acceptance = AcceptanceTracker()

    def metrics(self) -> dict[str, float]:
        return {"strategy/spec_on": float(self.on), "strategy/expected_speedup": self.last_gain,
                "strategy/accept_rate": self.acceptance.rate}

    def state_dict(self) -> dict:
        return {"kind": "fixed", "shape": [self.drafter, self.max_depth, self.width], "costs": self.costs.state_dict(),
                "acceptance": self.acceptance.state_dict(),
                "draft_seconds": [[b, s] for b, s in self.draft_seconds.items()], "on": self.on,
                "last_gain": self.last_gain}

    def load_state_dict(self, state: dict) -> None:
        check_selector_state(state, "fixed", [self.drafter, self.max_depth, self.width], "(drafter, depth, width)")
        self.costs.load_state_dict(state["costs"])
        self.acceptance.load_state_dict(state["acceptance"])
        self.draft_seconds = {int(b): float(s) for b, s in state["draft_seconds"]}
        self.on, self.last_gain = bool(state["on"]), float(state["last_gain"])

    def gain(self, batch: int, depth: int) -> float:
        """Estimated tokens per second with `depth` drafts over tokens per second without."""
        arm = Arm(self.drafter, depth, self.width)
        rel = self.costs.relative(batch, 1 + arm.nodes)
        plain = self.costs.cost(batch, 1)
        if rel is None or not plain:
            return 0.0
        draft = self.draft_seconds.get(bucket(batch), 0.0) / plain
        # the tracked rate is per level of this shape: a chain token, or any of `width` siblings
        return self.acceptance.expected_tokens(depth) / (rel + draft)

    def choose(self, batch: int) -> Arm:
        if self.max_spec_batch is not None and batch > self.max_spec_batch:
            self.on = False
            return OFF
        best_depth, best = max(((d, self.gain(batch, d)) for d in self.depths()), key=lambda x: x[1])
        self.last_gain = best
        self.on = best > (1 - HYSTERESIS if self.on else 1 + HYSTERESIS)
        return Arm(self.drafter, best_depth, self.width) if self.on else OFF

    def observe(self, arm: Arm, batch: int, seconds: float, draft_seconds: float,
                drafted: list[int], accepted: list[int]) -> None:
        self.costs.observe(batch, 1 + arm.nodes, seconds)
        if arm.speculative:
            key = bucket(batch)
            old = self.draft_seconds.get(key)
            self.draft_seconds[key] = draft_seconds if old is None else 0.8 * old + 0.2 * draft_seconds
            # evidence per level: a tree of n nodes offers n // width levels, each passed or not
            levels = [n if self.width == 1 else max(1, n // self.width) for n in drafted]
            self.acceptance.observe(levels, accepted)



@SELECTORS.register("fixed")
def _fixed(spec, drafters: list[str], learned: tuple[str, ...]) -> LongTailSelector:
    """The configured drafter (the first of the set) and shape, deeper as the batch shrinks."""
    return LongTailSelector(drafters[0], spec.num_draft_tokens, spec.tree_width, spec.max_spec_batch)
