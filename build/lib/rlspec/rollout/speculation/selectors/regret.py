"""A selector's regret against the best fixed arm over one generate call (strategy/regret).

Per decode step t, in bucket b with live batch B_t: n_t = sum_i (accepted_i + 1) tokens emitted,
s_t = seconds spent (forward + verify + commit + drafting). The call took S = sum_t s_t.

An arm a with estimated speedup est_b(a) over plain decoding (the selector's estimate: prior blended
with measurements) emits B est_b(a) tokens per plain step c(b, 1), so n tokens at batch B take
n c(b, 1) / (B est_b(a)) seconds. Playing one arm a at every step, the call's tokens would take

    S(a) = sum_b c(b, 1) / est_b(a) * sum_{t in b} n_t / B_t,

and the best fixed arm is a* = argmin_a S(a) over the arms the selector may play now. Then

    strategy/regret = S / S(a*) - 1

(0: as fast as the best single arm; 0.1: 10% slower; below 0 when choosing per bucket beat every
single arm). A bucket without a plain-decode cost counts its measured seconds on both sides.
Estimates are read when the metric is, so the comparison uses the selector's latest knowledge.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class RegretLedger:
    seconds: dict = field(default_factory=dict)  # bucket -> sum of s_t
    row_tokens: dict = field(default_factory=dict)  # bucket -> sum of n_t / B_t

    def record(self, b: int, batch: int, emitted: int, seconds: float) -> None:
        self.seconds[b] = self.seconds.get(b, 0.0) + seconds
        self.row_tokens[b] = self.row_tokens.get(b, 0.0) + emitted / max(batch, 1)

    def clear(self) -> None:
        self.seconds.clear()
        self.row_tokens.clear()

    def fixed_arm_seconds(self, arm, plain: Callable[[int], float | None],
                          est: Callable[[object, int], float]) -> float:
        """S(arm): the estimated seconds of this call's tokens with `arm` at every step."""
        total = 0.0
        for b, spent in self.seconds.items():
            c1, e = plain(b), est(arm, b)
            total += c1 * self.row_tokens[b] / e if c1 and e > 0 else (spent if not c1 else float("inf"))
        return total

    def regret(self, arms, plain: Callable[[int], float | None],
               est: Callable[[object, int], float]) -> tuple[float, object] | None:
        """(S / S(a*) - 1, a*), or None before any step."""
        spent = sum(self.seconds.values())
        if spent <= 0 or not arms:
            return None
        best = min(arms, key=lambda a: self.fixed_arm_seconds(a, plain, est))
        ref = self.fixed_arm_seconds(best, plain, est)
        return (spent / ref - 1.0 if 0 < ref < float("inf") else 0.0), best
