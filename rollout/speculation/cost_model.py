"""Measured costs of target forwards and drafter acceptance, the facts strategy choices rest on.

cost(B, T): seconds of one target forward over B live sequences with T new tokens each. Seeded by
a short calibration (a few dummy forwards per batch bucket), then kept current by an exponential
moving average of every real step. Acceptance is tracked per drafter as a geometric model:
a = P(next draft accepted | the previous one was), the maximum-likelihood estimate from
accepted counts and the number of verifies that stopped on a rejection. Both are kept in the speculation
ledger (ledger.py), which alone writes them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from rlspec.rollout.runtime.device import DeviceTimer
from rlspec.rollout.speculation.buckets import bucket, reachable_buckets

EMA = 0.2  # weight of a new observation
ACCEPT_DECAY = 0.98  # old acceptance evidence fades by this per observed verify


def step_width(drafted: list[int]) -> int:
    """Tokens per row of the verify forward that carried these drafts (draft tokens or tree nodes per row):
    what its seconds are the cost of. An arm's nominal 1 + nodes overstated it when drafts came short (a
    model-free drafter finding fewer matches, none at all), making verifies look cheap and, with no drafts,
    leaving the plain-step cost the rewards divide by unrefreshed (docs/selectors.md)."""
    return 1 + max(drafted, default=0)


@dataclass
class CostModel:
    table: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, T) -> seconds

    def observe(self, batch: int, T: int, seconds: float) -> None:
        key = (bucket(batch), T)
        old = self.table.get(key)
        self.table[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def cost(self, batch: int, T: int) -> float | None:
        """Seconds for (batch, T); interpolated along T within the bucket when not measured."""
        b = bucket(batch)
        if (b, T) in self.table:
            return self.table[(b, T)]
        known = sorted((t, s) for (bb, t), s in self.table.items() if bb == b)
        if not known:
            return None
        lo = max(((t, s) for t, s in known if t <= T), default=known[0])
        hi = min(((t, s) for t, s in known if t >= T), default=known[-1])
        if hi[0] == lo[0]:
            return lo[1] * (T / lo[0] if T > lo[0] else 1.0)  # beyond the table: grow linearly
        return lo[1] + (hi[1] - lo[1]) * (T - lo[0]) / (hi[0] - lo[0])

    def state_dict(self) -> dict:
        """The measured table as plain lists (checkpoints: a resumed engine skips calibration)."""
        return {"table": [[b, t, s] for (b, t), s in self.table.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.table = {(int(b), int(t)): float(s) for b, t, s in state["table"]}

    def measured_buckets(self) -> list[int]:
        """The buckets the table has any entry for, ascending."""
        return sorted({b for b, _ in self.table})

    def relative(self, batch: int, T: int) -> float | None:
        """cost(B, T) / cost(B, 1): how many plain decode steps one verify of T tokens costs."""
        c1, ct = self.cost(batch, 1), self.cost(batch, T)
        return None if c1 is None or ct is None else ct / c1

    def calibrate(self, runner, max_batch: int, Ts: list[int], context: int = 128, repeats: int = 1,
                  skip: tuple[int, ...] = ()) -> dict[tuple[int, int], float]:
        """Time dummy forwards at each batch bucket at a few anchor sizes of Ts (once per engine; once
        per machine and model with the calibration cache, calibration_cache.py). skip: buckets whose
        entries are already known (loaded from that cache).

        Only anchors: the smallest and largest T and one in between; `cost` interpolates the
        rest along T, and real steps replace the guesses (EMA) as soon as an arm runs. Timing
        every size of a bandit's arm set at every bucket was most of an engine's start. Returns the
        entries it timed. Each anchor is timed between two device synchronisations (runner.synchronize;
        runtime/device.py): a CUDA step returns when its replay is queued, so an unsynchronised timer measured
        the launch and charged each anchor with the previous shape's kernels."""
        sizes = sorted(set(Ts))
        anchors = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
        timed = {}
        for b in reachable_buckets(max_batch):
            if b in skip:
                continue
            n = min(b, max_batch)  # the top bucket's largest batch
            start = torch.full((n,), context, dtype=torch.long)
            for T in anchors:  # warm-up: every shape timed below (a compiled step compiles at its first call,
                runner.step(torch.zeros(n, T, dtype=torch.long), start)  # seconds that are no step's cost)
            for T in anchors:
                tokens = torch.zeros(n, T, dtype=torch.long)
                with DeviceTimer(sync=runner.synchronize) as clock:
                    for _ in range(repeats):
                        runner.step(tokens, start)
                self.table[(b, T)] = timed[(b, T)] = clock.seconds / repeats
        return timed


@dataclass
class AcceptanceTracker:
    prior_accepts: float = 1.0  # a weak prior of a = 0.5 so that speculation gets tried at all
    prior_rejects: float = 1.0
    accepts: float = 0.0
    rejects: float = 0.0
    drafted_share: float = 1.0  # EMA of the share of sequences that received a non-empty draft

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, float(state[f.name]))

    def fade(self, keep: float) -> None:
        """Trust only `keep` of the evidence so far (the drafter behind it changed a little)."""
        self.accepts *= keep
        self.rejects *= keep

    @property
    def rate(self) -> float:
        a = self.accepts + self.prior_accepts
        return a / (a + self.rejects + self.prior_rejects)

    def expected_tokens(self, k: int, rate: float | None = None) -> float:
        """Expected tokens emitted per sequence per verify with k drafted levels: 1 + f (a + ... + a^k),
        a = the tracked rate unless a per-level rate is given."""
        return self.tokens_by_depth(k, rate)[k]

    def tokens_by_depth(self, k: int, rate: float | None = None) -> list[float]:
        """expected_tokens(d, rate) for d = 0..k at once (the adaptive selector's estimates need every depth of a
        drafter and width each step): one running sum over the levels."""
        a = self.rate if rate is None else rate
        out, total = [1.0], 0.0
        for i in range(1, k + 1):
            total += a ** i
            out.append(1.0 + self.drafted_share * total)
        return out
