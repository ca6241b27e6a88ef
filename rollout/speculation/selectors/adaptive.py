"""Adaptive choice of how to speculate: a bounded bandit over drafters and draft shapes per batch size.

Arms are `Arm(drafter, depth, width)`: plain decoding (OFF), chains and small trees of several
drafters. Each live-batch bucket (`buckets.bucket`) is its own bandit: verification is cheap at
small batches and dear at large ones, so the best arm differs.

Reward: the step's speedup over plain decoding in its bucket (off is worth ~1 in every bucket),
    r = (sum_i (accepted_i + 1) / B) / ((seconds + draft_seconds) / cost(b, 1)), and 1 for plain decoding.

Prior, so that a new bucket's first choice is already sensible: with per-token acceptance a (one
AcceptanceTracker per drafter, fed by every bucket), width w lifting each level to
p = 1 - (1 - a)^w (as FixedSelector.gain), depth d, f the share of sequences given a draft,
    prior = (1 + f (p + ... + p^d)) / (cost(b, 1 + d w) / cost(b, 1) + d draft_level(b) / cost(b, 1)),
times a per-(bucket, drafter, width) bias, measured / predicted over its recent steps, which absorbs
what the model misses (overheads, how much a drafter's trees really gain).

Estimate: est = (n0 prior + S) / (n0 + W); S, W an arm's reward sum and count, all of a bucket's
evidence fading by `discount` per bucket step (discounted UCB): an arm in play is followed within
~100 steps, an arm left alone drifts back to the (kept current) prior. sigma is the bucket's relative
noise of one step's reward (B = 1 is far noisier than B = 64); est's standard error is
sigma est / sqrt(n0 + W).

Choice: the arm of highest est, replaced by an exploration only while explorations stay within
`explore_cap` of the steps (per bucket, overall, and over the last ~100 bucket steps):
(1) a probe of a drafter unused for `probe_every` steps, or with too little evidence (new, reset),
    using the arm that would beat the best at the lowest acceptance, if any could;
(2) else UCB: argmax est + c best sigma sqrt(ln n / (n0 + W)), n the bucket's discounted steps.
An arm below `bench_ratio` x best even 2 standard errors up is benched (not explored) for
`bench_steps` bucket steps. Off needs no rule: it wins when every draft costs more than it brings.

A changed drafter: when its acceptance over its last ~2 uses is far from the tracker's (3 standard
errors + `jump_margin`), or the engine says its weights were replaced (`reset_acceptance`, or
assigning a fresh `acceptance`), its evidence, measurements and bias are dropped and it is probed
again. An online trainer's update (`reset_acceptance(name, keep)`) only fades the acceptance
evidence: dropping it at every update put the drafter back on its optimistic prior over and over.

Every figure the estimates price with (costs, acceptance, drafting, the loss guard's S and P) is read from the
ledger (ledger.py), which `observe` writes once per step. Whether a step may speculate at all (max_spec_batch,
health, the loss guard) is the decision pipeline's (decide.py); this class only picks among the arms.

A learned drafter is an arm only while its gate is open (selectors/gate.py): an untrained one never
is, one judged by its trainer or by measurements only while its best prior gain exceeds 1.05.
`metrics` reports the call's regret against the best fixed arm (selectors/regret.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlspec.rollout.registry import DRAFTERS
from rlspec.rollout.speculation.buckets import bucket
from rlspec.rollout.speculation.cost_model import AcceptanceTracker, CostModel
from rlspec.rollout.speculation.ledger import AcceptanceBook, Ledger
from rlspec.rollout.speculation.selectors.adaptive_state import ArmStat, BucketState, adaptive_state, \
    load_adaptive_state
from rlspec.rollout.speculation.selectors.arms import arm_name, default_arms, expected_tokens, tokens_by_depth
from rlspec.rollout.speculation.selectors.base import OFF, SELECTORS, Arm
from rlspec.rollout.speculation.selectors.gate import acceptance_tracker, make_gates
from rlspec.rollout.speculation.selectors.loss_guard import LossGuard
from rlspec.rollout.speculation.selectors.regret import RegretLedger

RECENT = 0.99  # the exploration cap also holds over ~100 bucket steps: no saved-up bursts
NOISE_EMA = 0.05
THIN_PROBE_EVERY = 20  # steps between probes of a drafter whose tracker holds too little evidence
PROBE_RECHECK = 8  # steps before a due drafter that no arm could make win is checked again
# Most plain steps a probe may cost beyond its own step: the arm's verify and drafting in plain steps, less one.
# Acceptance is one figure per drafter whatever the batch, so the cheapest bucket's probe tells as much as a dear
# one's; on 2 CPU cores a 32-row probe cost 1.6-8 plain steps (a 4-deep chain, a learned drafter's catch-up)
# where its 1-4 row probes cost 0.1-0.5 (docs/selectors.md). On a GPU, where verifying a few more
# tokens is nearly free at every batch, every bucket stays probe-able.
PROBE_MAX_LOSS = 0.6


@dataclass
class AdaptiveSelector:
    arms: list[Arm]  # OFF is added in front when missing
    explore_cap: float = 0.1  # most share of steps spent exploring (per bucket, overall, lately)
    ucb_c: float = 0.7  # UCB bonus in standard errors of the estimate (times sqrt(ln n))
    prior_weight: float = 2.0  # the cost model's guess counts as this many measured steps
    discount: float = 0.99  # evidence in a bucket ages by this per bucket step (~100-step memory)
    bench_ratio: float = 0.7  # an arm clearly below this share of the best is benched
    bench_steps: int = 500  # bucket steps a bench lasts
    probe_every: int = 200  # steps after which an unused drafter's acceptance is re-checked
    jump_margin: float = 0.15  # recent acceptance this far (+ 3 standard errors) off = a new drafter
    jump_min_trials: float = 8.0  # ... judged once the recent evidence has this many trials
    ledger: Ledger = field(default_factory=Ledger)  # costs, acceptance, drafting, savings (ledger.py)
    gates: dict = field(default_factory=dict)  # learned drafter -> LearnedGate (absent: always an arm)
    regret: RegretLedger = field(default_factory=RegretLedger)  # this call's steps, for strategy/regret
    guard: LossGuard = field(default_factory=LossGuard)  # speculation loses at most alpha of plain time (loss_guard.py)
    buckets: dict = field(default_factory=dict)  # bucket -> BucketState
    last_seen: dict = field(default_factory=dict)  # drafter -> step it was last observed
    steps: int = 0
    explores: int = 0
    last: tuple | None = None  # (arm, bucket, batch, estimates) of the latest choice
    # (drafter, bucket) -> step at which a due probe found no arm that could win: re-checked PROBE_RECHECK steps on
    # (every step, a due drafter's check was half of `choose`'s time, which the step pays)
    probe_checked: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if OFF not in self.arms:
            self.arms = [OFF] + list(self.arms)  # plain decoding is always a choice and the reference
        for name, gate in self.gates.items():
            gate.bind(self.ledger, name)
        self._max_depth = max(a.depth for a in self.arms)
        self.refresh_playable()  # and again when a gate opens or closes (_check_gates)

    # ---- engine-facing surface ----------------------------------------------------------------
    @property
    def costs(self) -> CostModel:
        return self.ledger.costs

    @costs.setter
    def costs(self, costs: CostModel) -> None:
        self.ledger.costs = costs

    @property
    def acceptance(self) -> AcceptanceBook:
        return self.ledger.acceptance

    @acceptance.setter
    def acceptance(self, book) -> None:
        """RolloutEngine assigns a fresh book when drafter weights change: the measurements of the
        drafters it drops are stale too."""
        for name in set(self.ledger.acceptance) - set(book):
            self._forget(name)
        self.ledger.acceptance = AcceptanceBook(book)

    def reset_acceptance(self, drafter: str, keep: float = 0.0) -> None:
        """`drafter`'s weights changed. keep = 0: drop its evidence and measurements and re-check it
        soon. keep > 0 (an online update): fade its acceptance evidence to that share and keep the
        rest; the change detector still catches an update that moved acceptance far."""
        if keep > 0:
            self.ledger.acceptance[drafter].fade(keep)
            return
        self.ledger.acceptance[drafter] = acceptance_tracker(self.gates.get(drafter))
        self._forget(drafter)

    def admit(self, drafter: str, rate: float | None = None) -> None:
        """Evidence for a learned drafter's gate: its trainer's estimated per-token acceptance of the
        weights drafting now (also its tracker's prior), or None: weights from elsewhere (trusted)."""
        gate = self.gates.get(drafter)
        if gate is None:
            return
        gate.admit(rate, self.ledger.acceptance[drafter])

    def begin_call(self) -> None:
        """A generate call starts: strategy/regret covers its steps only."""
        self.regret.clear()

    def depths(self) -> list[int]:
        """Distinct draft sizes (nodes) of the arms; 1 + each is a verify size to calibrate."""
        return sorted({a.nodes for a in self.arms if a.speculative})

    def verify_sizes(self) -> list[int]:
        """Every T the cost model should be calibrated at."""
        return [1] + [1 + n for n in self.depths()]

    @property
    def max_nodes(self) -> int:
        return max(self.depths(), default=0)

    def choose(self, batch: int) -> Arm:
        """The best arm by estimate, or an exploration within the cap; the decision pipeline (decide.py) applies
        the loss guard to it."""
        b = bucket(batch)
        st = self._tick(b)
        est = self._estimates(self._check_gates(), b)
        greedy = max(est, key=est.__getitem__)  # ties: earlier in the list (off first)
        arm = greedy
        # the exploration rules only where the cap lets an exploration happen: most steps it does not (3% in the
        # engine), and they were over half of this method's time, which every step pays
        if self._may_explore(st):
            self._update_bench(st, est, est[greedy])
            pick = self._stale_probe(est, greedy, b) or self._ucb_pick(st, est, greedy)
            if pick != greedy and self.guard.admits(self.ledger, pick, b):
                arm = pick
                st.explores += 1
                st.recent_explores += 1.0
                self.explores += 1
        self.last = (arm, b, batch, est)
        return arm

    def overruled(self, arm: Arm) -> None:
        """The decision pipeline played `arm` instead of this step's pick (the loss guard held it)."""
        if self.last is not None:
            self.last = (arm, *self.last[1:])

    def gated(self) -> bool:
        """Whether the learned drafters' gates leave no speculative arm to play."""
        return not self._any_playable

    def observe(self, arm: Arm, batch: int, seconds: float, draft_seconds: float,
                drafted: list[int], accepted: list[int]) -> None:
        if seconds is None:  # no cost measured: the acceptance alone (the ledger's)
            self.ledger.record(arm, batch, None, None, drafted, accepted, changed=self._changed)
            return
        b = bucket(batch)
        st = self._bucket(b)
        self.regret.record(b, batch, sum(a + 1 for a in accepted), seconds + draft_seconds)
        reward = self._reward(arm, b, seconds, draft_seconds, accepted)
        self._track_noise(st, arm, reward, self.estimate(arm, b))  # plain steps too: they are most of the noise
        self.ledger.record(arm, batch, seconds, draft_seconds, drafted, accepted, changed=self._changed)
        if arm.speculative:
            self.last_seen[arm.drafter] = self.steps
        # plain decoding's speedup over itself is 1 by definition. Measured, it read cost(b, 1), a lagging EMA,
        # over this step: ~0.6-0.9 for a while after the batch entered a bucket whose figure came from
        # calibration (the forward alone, a shorter context), and arms whose priors were below 1 won on that
        self._record(st, arm, reward if arm.speculative else 1.0, self._prior(arm, b))

    def metrics(self) -> dict[str, float]:
        """strategy/arm (index into arms), strategy/explore_share, strategy/expected_speedup of the
        chosen arm, and per arm strategy/expected_goodput/<name> in tokens/s at the latest batch."""
        if self.last is None:
            return {}
        arm, b, batch, est = self.last
        out = {"strategy/arm": float(self.arms.index(arm)) if arm in self.arms else -1.0,
               "strategy/explore_share": self.explores / max(self.steps, 1),
               "strategy/bucket": float(b), "strategy/guard_held": float(self.guard.held)}
        plain = self.ledger.plain(b)
        if est and plain:
            out["strategy/expected_speedup"] = est.get(arm, 0.0)
            for a in est:
                out[f"strategy/expected_goodput/{arm_name(a)}"] = est[a] * batch / plain
        for name, gate in self.gates.items():
            out[f"strategy/gate/{name}"] = float(gate.open)
        regret = self.regret.regret(self._playable, self.ledger.plain, self.estimate)
        if regret is not None:
            out["strategy/regret"] = regret[0]
            out["strategy/best_fixed_arm"] = float(self.arms.index(regret[1]))
        return out

    def state_dict(self) -> dict:
        """What the bandit learned, as plain values (selectors/adaptive_state.py)."""
        return adaptive_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict() of a selector with the same arms (ValueError naming both otherwise)."""
        load_adaptive_state(self, state)

    # ---- estimates ----------------------------------------------------------------------------
    def estimate(self, arm: Arm, b: int) -> float:
        """Expected speedup over plain decoding in bucket b: the prior blended with measurements."""
        return self._estimates([arm], b)[arm]

    def _estimates(self, arms: list[Arm], b: int) -> dict[Arm, float]:
        """estimate(a, b) of each arm, each verify size's relative cost, each drafter's acceptance and drafting
        cost, and each (drafter, width)'s expected tokens by depth and bias computed once: arm by arm they were
        computed again for each of ~25 arms, and this is most of `choose`, which every step pays."""
        st = self._bucket(b)
        relative, drafters, shapes, out = {}, {}, {}, {}
        for arm in arms:
            guess = 1.0
            if arm.speculative:
                T = 1 + arm.nodes
                if T not in relative:
                    relative[T] = self.ledger.relative(b, T)
                if arm.drafter not in drafters:
                    tr = self.ledger.acceptance[arm.drafter]
                    drafters[arm.drafter] = (tr, tr.rate, self.ledger.draft_steps(arm.drafter, b))
                tr, rate, level = drafters[arm.drafter]
                shape = (arm.drafter, arm.width)  # expected tokens by depth and the bias: per drafter and width
                if shape not in shapes:
                    shapes[shape] = (tokens_by_depth(arm.width, tr, rate, self._max_depth), self._bias(st, arm))
                tokens, bias = shapes[shape]
                guess = tokens[arm.depth] / (relative[T] + level * arm.depth) * bias
            s = st.stats.get(arm)
            out[arm] = guess if s is None else (self.prior_weight * guess + s.total) / (self.prior_weight + s.weight)
        return out

    def _prior(self, arm: Arm, b: int, rate: float | None = None) -> float:
        if not arm.speculative:
            return 1.0
        return expected_tokens(arm, self.ledger.acceptance[arm.drafter], rate) / self.ledger.steps_per_verify(arm, b)

    def _check_gates(self) -> list[Arm]:
        """The arms that may be played now: a gated drafter's only while its gate is open."""
        changed = False
        for name, gate in self.gates.items():
            was = gate.open
            changed |= was != gate.check(self.steps, lambda: self._best_gain(name))
        if changed:
            self.refresh_playable()
        return self._playable

    def refresh_playable(self) -> None:
        self._playable = [a for a in self.arms if a.drafter not in self.gates or self.gates[a.drafter].open]
        self._any_playable = any(a.speculative for a in self._playable)

    def _best_gain(self, drafter: str) -> float:
        """The drafter's highest prior (no bias) over the calibrated buckets (bucket 1 when none is)."""
        known = self.costs.measured_buckets() or [1]
        arms = [a for a in self.arms if a.drafter == drafter]
        return max((self._prior(a, bb) for bb in known for a in arms), default=0.0)

    def _bias(self, st: BucketState, arm: Arm) -> float:
        """Measured / predicted for this drafter here; shrunk toward 1 by a pseudo step of speedup 2
        and clipped, so that a few odd steps cannot swing it."""
        r, p = st.bias.get((arm.drafter, arm.width), (0.0, 0.0))
        return min(2.0, max(0.5, (r + 2.0) / (p + 2.0)))

    def _stderr(self, st: BucketState, arm: Arm) -> float:
        """Relative standard error of est[arm]."""
        s = st.stats.get(arm)
        return math.sqrt(st.noise_var / (self.prior_weight + (s.weight if s else 0.0)))

    # ---- choosing -----------------------------------------------------------------------------
    def _ucb_pick(self, st: BucketState, est: dict, greedy: Arm) -> Arm:
        recent = sum(s.weight for s in st.stats.values())  # discounted step count (D-UCB)
        scale = self.ucb_c * est[greedy] * math.sqrt(math.log(max(recent, 2.0)))
        open_arms = [a for a in est if a not in st.bench or a == greedy]
        return max(open_arms, key=lambda a: est[a] + scale * self._stderr(st, a))

    def _stale_probe(self, est: dict, greedy: Arm, b: int) -> Arm | None:
        """A drafter unused for probe_every steps may have changed (new weights, a drifted policy),
        and one with little evidence (new, just reset, one unlucky probe) is not known yet: re-check
        it where even perfect acceptance could beat the current best."""
        for name in dict.fromkeys(a.drafter for a in est if a.speculative):
            tr = self.ledger.acceptance[name]
            due = THIN_PROBE_EVERY if tr.accepts + tr.rejects < 2 * self.jump_min_trials else self.probe_every
            if name == greedy.drafter or self.steps - self.last_seen.get(name, 0) < due or \
                    self.steps - self.probe_checked.get((name, b), -PROBE_RECHECK) < PROBE_RECHECK:
                continue
            arm = self._probe_arm(name, b, est[greedy])
            if arm is not None:
                return arm
            self.probe_checked[(name, b)] = self.steps
        return None

    def _probe_arm(self, name: str, b: int, best: float) -> Arm | None:
        """The drafter's arm that would beat `best` at the lowest acceptance, if any would: it is the
        one whose result tells most about whether the drafter can win now. Only arms that cost at most
        PROBE_MAX_LOSS plain steps beyond a plain step are probes: a dear bucket leaves the check to a cheap one."""
        st = self._bucket(b)
        steps = {a: self.ledger.steps_per_verify(a, b) for a in self.arms if a.drafter == name}
        arms = [a for a, s in steps.items() if s <= 1 + PROBE_MAX_LOSS]  # probes that cannot cost much
        if not arms:
            return None
        # the cost side once per arm, not once per rate: a drafter that stays due re-checks at every step
        scale = {a: self._bias(st, a) / steps[a] for a in arms}
        tracker = self.ledger.acceptance[name]
        for rate in (0.5, 0.7, 0.85, 1.0):
            value = {a: expected_tokens(a, tracker, rate) * scale[a] for a in arms}
            arm = max(arms, key=value.__getitem__)
            if value[arm] > best:
                return arm
        return None

    def _may_explore(self, st: BucketState) -> bool:
        return (st.explores + 1 <= self.explore_cap * st.steps
                and self.explores + 1 <= self.explore_cap * self.steps
                and st.recent_explores + 1 <= self.explore_cap * st.recent_steps)

    def _update_bench(self, st: BucketState, est: dict, best: float) -> None:
        for arm in est:
            if arm in st.bench:
                if st.bench[arm] <= st.steps or est[arm] >= best:  # over, or best again
                    del st.bench[arm]
            elif est[arm] * (1 + 2 * self._stderr(st, arm)) < self.bench_ratio * best:
                st.bench[arm] = st.steps + self.bench_steps

    # ---- observing ----------------------------------------------------------------------------
    def _reward(self, arm: Arm, b: int, seconds: float, draft_seconds: float, accepted: list[int]) -> float:
        """Speedup of this step over plain decoding in the same bucket (see the module docstring)."""
        plain = self.ledger.plain(b) or seconds / self.ledger.relative(b, 1 + arm.nodes)
        per_seq = sum(a + 1 for a in accepted) / max(len(accepted), 1)
        return per_seq * plain / max(seconds + draft_seconds, 1e-9)

    def _track_noise(self, st: BucketState, arm: Arm, reward: float, predicted: float) -> None:
        """Only arms with a few measurements: a prior's bias is not noise."""
        s = st.stats.get(arm)
        if s is not None and s.weight >= 3.0 and predicted > 0:
            st.noise_var = (1 - NOISE_EMA) * st.noise_var + NOISE_EMA * (reward / predicted - 1) ** 2

    def _changed(self, drafter: str, acc: float, rej: float) -> bool:
        """The change detector over the ledger's fresh view: a changed drafter is reset and re-checked."""
        if not self._jumped(self.ledger.acceptance[drafter], acc, rej):
            return False
        self.reset_acceptance(drafter)
        return True

    def _jumped(self, tr: AcceptanceTracker, acc: float, rej: float) -> bool:
        """Is the recent acceptance far outside what the tracker's (larger) evidence allows?"""
        m = acc + rej
        if m < self.jump_min_trials or tr.accepts + tr.rejects < 2 * m:
            return False
        old = tr.rate
        return abs(acc / m - old) > 3 * math.sqrt(old * (1 - old) / m) + self.jump_margin

    def _record(self, st: BucketState, arm: Arm, reward: float, prior: float) -> None:
        s = st.stats.setdefault(arm, ArmStat())
        s.weight += 1.0
        s.total += reward
        if arm.speculative:
            key = (arm.drafter, arm.width)  # per width too: how much a tree gains varies by drafter
            r, p = st.bias.get(key, (0.0, 0.0))
            st.bias[key] = (self.discount * r + reward, self.discount * p + prior)

    def _forget(self, drafter: str) -> None:
        self.last_seen[drafter] = self.steps - self.probe_every  # a freshness probe is due at once
        self.ledger.forget(drafter)
        for st in self.buckets.values():
            for arm in [a for a in st.stats if a.drafter == drafter]:
                del st.stats[arm]
            for arm in [a for a in st.bench if a.drafter == drafter]:
                del st.bench[arm]
            for key in [k for k in st.bias if k[0] == drafter]:  # tree gains change with the drafter
                del st.bias[key]

    def _tick(self, b: int) -> BucketState:
        st = self._bucket(b)
        st.steps += 1
        self.steps += 1
        st.recent_steps = RECENT * st.recent_steps + 1.0
        st.recent_explores *= RECENT
        for s in st.stats.values():  # old measurements fade: unplayed arms drift back to the prior
            s.weight *= self.discount
            s.total *= self.discount
        return st

    def _bucket(self, b: int) -> BucketState:
        return self.buckets.setdefault(b, BucketState())


@SELECTORS.register("adaptive")
def _adaptive(spec, drafters: list[str], learned: tuple[str, ...]) -> AdaptiveSelector:
    """A bandit over every drafter of the set x chain depths x tree widths (x stop rules if learned)."""
    widths = (spec.tree_width,) if spec.tree_width > 1 else (2, 3)
    registered = DRAFTERS.names()  # a drafter given as an instance (the engine's `drafter=`) is not
    chains = tuple(d for d in drafters if d in registered and DRAFTERS.meta(d).get("chains_only"))
    arms = default_arms(drafters, max_depth=spec.num_draft_tokens, widths=widths, learned=learned,
                        chains_only=chains)
    gates = make_gates(learned, trusted=bool(spec.drafter_path))  # a cold learned drafter waits for evidence
    # exploring a losing arm at a large batch costs up to ~2x a plain step on a CPU, so the engine explores at
    # most 3% of steps (docs/selectors.md); the class default stays general
    return AdaptiveSelector(arms, explore_cap=0.03, gates=gates)
