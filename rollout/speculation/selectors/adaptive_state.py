"""The adaptive selector's state as plain Python values, for checkpoints (AdaptiveSelector.state_dict).

Everything the bandit learned between generate() calls: its ledger (costs, acceptance, drafting, savings:
ledger.py), per bucket the discounted arm statistics, benches and biases, when each drafter was last seen, the
learned drafters' gates, the loss guard's settings, the step counters and the last choice (for metrics). The regret
record is per call and not saved. Arms become tuples (selectors.base.arm_key) and dicts become lists of pairs in
insertion order, so that torch.load(weights_only=True) reads it back and a restored selector iterates exactly as
the saved one did. The arm list itself is the state's "shape": a state only loads into a selector with the same
arms (same drafters, num_draft_tokens, tree_width).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlspec.rollout.speculation.ledger import legacy_ledger_state
from rlspec.rollout.speculation.selectors.base import arm_key, arm_of, check_selector_state


@dataclass
class ArmStat:
    weight: float = 0.0  # discounted number of plays
    total: float = 0.0  # discounted sum of rewards


@dataclass
class BucketState:
    steps: int = 0
    explores: int = 0
    recent_steps: float = 0.0  # discounted by RECENT per step
    recent_explores: float = 0.0
    noise_var: float = 0.09  # relative variance of one step's reward about its arm's estimate
    stats: dict = field(default_factory=dict)  # Arm -> ArmStat
    bench: dict = field(default_factory=dict)  # Arm -> bucket step at which its bench ends
    bias: dict = field(default_factory=dict)  # (drafter, width) -> (discounted reward, prior sums)


def adaptive_state(sel) -> dict:
    """AdaptiveSelector -> a dict of lists, tuples, strings and numbers."""
    last = None
    if sel.last is not None:
        arm, b, batch, est = sel.last
        last = [arm_key(arm), b, batch, [[arm_key(a), v] for a, v in est.items()]]
    return {"kind": "adaptive", "shape": [arm_key(a) for a in sel.arms], "ledger": sel.ledger.state_dict(),
            "buckets": [[b, _bucket_state(st)] for b, st in sel.buckets.items()],
            "last_seen": [[d, step] for d, step in sel.last_seen.items()],
            "gates": [[d, gate.state_dict()] for d, gate in sel.gates.items()],
            "steps": sel.steps, "explores": sel.explores, "last": last, "guard": sel.guard.state_dict()}


def load_adaptive_state(sel, state: dict) -> None:
    """Restore adaptive_state(...) into `sel`, an AdaptiveSelector with the same arms."""
    check_selector_state(state, "adaptive", [arm_key(a) for a in sel.arms], "arms")
    sel.ledger.load_state_dict(state["ledger"] if "ledger" in state else legacy_ledger_state(state))
    sel.buckets = {int(b): _load_bucket(BucketState(), st) for b, st in state["buckets"]}
    sel.last_seen = {d: int(step) for d, step in state["last_seen"]}
    for d, gate in state.get("gates", []):  # absent in states saved before the gates existed
        if d in sel.gates:
            sel.gates[d].load_state_dict(gate)
    sel.refresh_playable()
    sel.steps, sel.explores = int(state["steps"]), int(state["explores"])
    if "guard" in state:  # absent in states saved before the loss guard existed: it starts afresh
        sel.guard.load_state_dict({"held": 0, **state["guard"]})
    sel.probe_checked = {}  # steps of this run's count: not carried over
    last = state["last"]
    sel.last = None if last is None else \
        (arm_of(last[0]), int(last[1]), int(last[2]), {arm_of(a): float(v) for a, v in last[3]})


def _bucket_state(st) -> dict:
    return {"steps": st.steps, "explores": st.explores, "recent_steps": st.recent_steps,
            "recent_explores": st.recent_explores, "noise_var": st.noise_var,
            "stats": [[arm_key(a), s.weight, s.total] for a, s in st.stats.items()],
            "bench": [[arm_key(a), end] for a, end in st.bench.items()],
            "bias": [[d, w, r, p] for (d, w), (r, p) in st.bias.items()]}


def _load_bucket(st, saved: dict):
    st.steps, st.explores = int(saved["steps"]), int(saved["explores"])
    st.recent_steps, st.recent_explores = float(saved["recent_steps"]), float(saved["recent_explores"])
    st.noise_var = float(saved["noise_var"])
    st.stats = {arm_of(a): ArmStat(float(w), float(t)) for a, w, t in saved["stats"]}
    st.bench = {arm_of(a): int(end) for a, end in saved["bench"]}
    st.bias = {(d, int(w)): (float(r), float(p)) for d, w, r, p in saved["bias"]}
    return st
