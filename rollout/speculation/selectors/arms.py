"""The adaptive selector's arm space and how one verify's outcome counts as evidence about a drafter.

Arms are `Arm(drafter, depth, width, stop)` (selectors/base.py): plain decoding (OFF), chains of 1, 2, 4, ...
nodes, trees of a few widths, and for learned drafters chains that end early by a stop rule. A drafter's
acceptance is one per-token rate whatever the shape (cost_model.AcceptanceTracker): `expected_tokens` turns it into
tokens per verify for an arm (a tree's width lifts each level to 1 - (1 - a)^w), and `path_evidence` maps what a
verify accepted back to per-token accepts and rejects.
"""
from __future__ import annotations

from rlspec.rollout.speculation.cost_model import AcceptanceTracker
from rlspec.rollout.speculation.selectors.base import OFF, Arm

STOP_RULES = ("max_conf", "entropy")


def default_arms(drafters: list[str], max_depth: int = 8, widths: tuple[int, ...] = (2, 3),
                 max_nodes: int | None = None, learned: tuple[str, ...] = ("eagle3",),
                 chains_only: tuple[str, ...] = ()) -> list[Arm]:
    """OFF, then per drafter chains of 1, 2, 4, ... max_depth and trees of each width, depth >= 2
    and at most max_nodes nodes (default: no limit beyond max_depth * max(widths)), no trees for the `chains_only`
    drafters (they would draft a chain of the tree's nodes); learned drafters also get the stop-rule arms."""
    max_nodes = max_nodes or max_depth * max(widths, default=1)
    depths, d = [], 1
    while d < max_depth:
        depths.append(d)
        d *= 2
    depths.append(max_depth)
    arms = [OFF]
    for name in drafters:
        arms += [Arm(name, d, 1) for d in depths]
        if name not in chains_only:
            arms += [Arm(name, d, w) for w in widths for d in depths if d >= 2 and d * w <= max_nodes]
        if name in learned:  # confidence/entropy stop rules need the drafter's distribution
            arms += [Arm(name, max_depth, 1, stop) for stop in STOP_RULES]
    return arms


def arm_name(arm: Arm) -> str:
    """Metric-friendly name: off, suffix_k4, eagle3_k4w2."""
    if not arm.speculative:
        return "off"
    name = f"{arm.drafter}_k{arm.depth}" + (f"w{arm.width}" if arm.width > 1 else "")
    return name + (f"_{arm.stop}" if arm.stop != "none" else "")


def expected_tokens(arm: Arm, tracker: AcceptanceTracker, rate: float | None = None) -> float:
    """Tokens per sequence per verify under the geometric model, width lifting every level."""
    if not arm.speculative:
        return 1.0
    p = 1 - (1 - (tracker.rate if rate is None else rate)) ** arm.width
    return tracker.expected_tokens(arm.depth, p)


def tokens_by_depth(width: int, tracker: AcceptanceTracker, rate: float, depth: int) -> list[float]:
    """expected_tokens of the arms (drafter, d, width) for d = 0..depth at once: one call per drafter and width in
    the selector's per-step estimates instead of one per arm."""
    return tracker.tokens_by_depth(depth, 1 - (1 - rate) ** width)


def path_evidence(arm: Arm, drafted: list[int], accepted: list[int]) -> tuple[float, float]:
    """Per-token (accepts, rejects) of one verify. A tree's per-level acceptance p maps back to
    a = 1 - (1 - p)^(1/w), so one tracker per drafter serves chains and trees alike."""
    acc = rej = 0.0
    for n, a in zip(drafted, accepted):
        if n > 0:
            depth = n if arm.width == 1 else max(1, n // arm.width)  # the path length the tree allowed
            acc += a
            rej += 1.0 if a < depth else 0.0
    m = acc + rej
    if arm.width > 1 and m > 0:
        a_tok = 1 - (1 - acc / m) ** (1 / arm.width)
        acc, rej = m * a_tok, m * (1 - a_tok)
    return acc, rej
