"""Arms, the `Selector` protocol every selector implements, and the selector registry.

An arm says which drafter runs and how deep and wide it drafts; depth 0 is plain decoding. Each
decode step the engine asks the selector for an arm for the live batch, then reports what the step
cost and how much was accepted. The maths of each selector is in docs/selectors.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlspec.rollout.speculation.cost_model import CostModel
from rlspec.rollout.registry import SELECTORS  # noqa: F401  (re-exported for selector modules)


@dataclass(frozen=True)
class Arm:
    drafter: str  # "none" or a registered drafter name
    depth: int = 0  # drafted tokens along a path; 0 = no speculation
    width: int = 1  # children per node; 1 = chain
    # learned drafters only: end a sequence's draft early when the drafter is unsure
    # ("max_conf": top-1 probability < 0.4; "entropy": SVIP's sqrt(0.15 H) > 0.3, H in nats)
    stop: str = "none"

    def __post_init__(self) -> None:  # arms key the selector's dicts, ~75 lookups a step: hash them once
        object.__setattr__(self, "_hash", hash((self.drafter, self.depth, self.width, self.stop)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt from its fields: a string's hash differs between processes
        return Arm, (self.drafter, self.depth, self.width, self.stop)

    @property
    def nodes(self) -> int:
        """Draft tree size: a chain of `depth`, or `width` branches of `depth` each."""
        return self.depth * self.width

    @property
    def speculative(self) -> bool:
        return self.depth > 0 and self.drafter != "none"


OFF = Arm("none")


def arm_key(arm: Arm) -> tuple:
    """An arm as a plain tuple (drafter, depth, width, stop): checkpoints hold no classes of ours."""
    return (arm.drafter, arm.depth, arm.width, arm.stop)


def arm_of(key) -> Arm:
    return Arm(str(key[0]), int(key[1]), int(key[2]), str(key[3]))


def check_selector_state(state: dict, kind: str, shape, shape_name: str) -> None:
    """Raise a ValueError saying what differs when a saved selector state (state_dict) does not fit
    this selector: another kind, or another shape (drafter, depths, widths: what arms it has)."""
    saved = state.get("kind")
    if saved != kind:
        raise ValueError(f"the checkpoint's selector state is for the {saved!r} selector, this engine's selector is "
                         f"{kind!r}; build the engine with the SpecConfig (selector, drafter) of the run that saved it")
    if list(state["shape"]) != list(shape):
        raise ValueError(f"the checkpoint's {kind!r} selector has {shape_name} {list(state['shape'])}, this engine's "
                         f"has {list(shape)}; build the engine with the SpecConfig (drafter, num_draft_tokens, "
                         "tree_width) of the run that saved it")


class Selector(Protocol):
    """Everything the engine calls on a selector. Optional, called when present: `admit(drafter, rate)`
    (evidence for a learned drafter's gate, selectors/gate.py), `begin_call()` (a generate call starts:
    per-call metrics such as strategy/regret restart), and for the decision pipeline (decide.py) `forced` (an
    arm for every step), `guard` (a LossGuard over the selector's ledger), `gated()` (the gates leave no
    speculative arm) and `overruled(arm)` (the pipeline played `arm` instead of the pick)."""

    # the selector's record of what steps cost and saved (ledger.py, which imports this module); `observe` writes
    # each step into it once
    ledger: "Ledger"  # noqa: F821
    costs: CostModel  # the ledger's forward costs per (batch bucket, tokens per row); the engine calibrates it

    @property
    def max_nodes(self) -> int:
        """The largest draft any arm asks for (the engine reserves cache slack for it)."""

    def verify_sizes(self) -> list[int]:
        """Tokens per row of every forward an arm can cause (1 = plain decode): the cost model's
        calibration points; empty when the selector never reads costs."""

    def choose(self, batch: int) -> Arm:
        """The arm for the next decode step of a live batch of this size."""

    def observe(self, arm: Arm, batch: int, seconds: float, draft_seconds: float,
                drafted: list[int], accepted: list[int]) -> None:
        """What the step cost (verify forward, drafting) and what each row drafted and accepted: recorded in the
        ledger (`self.ledger.record(...)`), then whatever the selector learns from it. seconds and draft_seconds
        None: the step's time measures no cost (it captured its graph first); its acceptance still counts."""

    def reset_acceptance(self, drafter: str, keep: float = 0.0) -> None:
        """The drafter's weights changed: acceptance measured on the old weights is stale. keep: the
        share of that evidence still trusted (0: none, a different drafter; an online trainer's
        update, a small step from the old weights, keeps some)."""

    def metrics(self) -> dict[str, float]:
        """strategy/* metrics for engine.stats()."""

    def state_dict(self) -> dict:
        """Everything learned so far (costs, acceptance, statistics) as plain Python values, with
        "kind" and "shape" naming what it fits (check_selector_state)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict of a selector built the same way (ValueError otherwise)."""
