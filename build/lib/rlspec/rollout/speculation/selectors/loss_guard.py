"""LossGuard: speculation may never cost a run more than a small share of its decode time.

The bandit (bandit.py) chooses from a model: expected tokens over predicted cost. The model misses what it
cannot see (a probe's catch-up, per-step bookkeeping, a context longer than calibration's), and exploring
costs steps by design; over a short run or a workload where nothing pays, those losses add up (a 6-step GRPO
run: `auto` 20% slower than plain decoding). The guard is the constraint of a conservative bandit (Wu et al.,
"Conservative Bandits", 2016): with the baseline arm (plain decoding) known to be safe, a risky choice is made
only while the run's realized reward stays above (1 - alpha) of the baseline's, even if it loses everything.

Measured, not modelled:
    P = the seconds plain decoding would have taken for every decode step so far: a plain step's own
        seconds, and for a speculative step the positions it advanced its rows (accepted + 1, averaged over
        rows) times the bucket's plain step time (an EMA of its measured plain steps; the cost model's guess
        until there is one);
    S = the seconds speculation saved: sum over speculative steps of that plain equivalent minus the step's
        seconds, drafting included (negative: lost).
A speculative arm is played only if S - max(L, 0) >= -alpha P, L being what the step loses if its drafter's
acceptance is at the low end of its evidence (the selector's bound: predicted seconds less the tokens expected
at mean - 2 sd of the per-token rate; an untried drafter counts as never accepted). So S never falls more than
one step's misprediction below -alpha P, and once it is below, nothing speculates until plain steps have
raised the floor: the run decodes at >= ~(1 - alpha) of plain decoding's speed, whatever the drafters and the
cost model do. A drafter that pays raises S and with it the room to explore; one that does not is held to
alpha; a drafter whose gain is established (L <= 0) plays from the first step while S is above the floor. The same
quantity is reported as rollout/spec_saved_s (rollout/metrics.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

PLAIN_EMA = 0.1  # a bucket's plain step time follows its last ~10 plain steps (context grows as a call runs)


@dataclass
class LossGuard:
    alpha: float = 0.02  # most share of plain decoding's time speculation may lose over a run
    saved: float = 0.0  # S: realized seconds saved by speculative steps (negative: lost)
    plain_time: float = 0.0  # P: what plain decoding would have taken for every step so far
    plain_step: dict = field(default_factory=dict)  # bucket -> EMA seconds of a plain step
    held: int = 0  # speculative choices turned into plain steps

    def allows(self, loss_s: float) -> bool:
        """Whether a speculative step that may lose `loss_s` seconds (its bound) keeps S >= -alpha P."""
        if self.alpha == float("inf"):  # no floor (inf x 0 would read as nan)
            return True
        return self.saved - max(loss_s, 0.0) >= -self.alpha * self.plain_time

    def plain_seconds(self, b: int, guess: float | None) -> float | None:
        """Bucket b's plain step: measured (EMA), else `guess` (the cost model's)."""
        return self.plain_step.get(b, guess)

    def observe(self, b: int, speculative: bool, seconds: float, advanced: float, guess: float | None) -> None:
        """A decode step in bucket b that took `seconds` (drafting included) and moved its rows `advanced`
        positions on average (1 for a plain step); guess: the cost model's plain step seconds for b."""
        if not speculative:
            old = self.plain_step.get(b)
            self.plain_step[b] = seconds if old is None else old + PLAIN_EMA * (seconds - old)
            self.plain_time += seconds
            return
        plain = self.plain_seconds(b, guess)
        if plain is None:  # nothing to compare with yet: count the step as breaking even
            plain = seconds / max(advanced, 1e-9)
        self.plain_time += advanced * plain
        self.saved += advanced * plain - seconds

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "saved": self.saved, "plain_time": self.plain_time, "held": self.held,
                "plain_step": [[b, s] for b, s in self.plain_step.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.alpha, self.saved = float(state["alpha"]), float(state["saved"])
        self.plain_time, self.held = float(state["plain_time"]), int(state["held"])
        self.plain_step = {int(b): float(s) for b, s in state["plain_step"]}
