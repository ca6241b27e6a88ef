"""The Ray pool's side of drafter health (rollout/speculation/drafter_health.py has the logic and its reasons).

The pool reports what it knows: each drafter version it publishes (fingerprinted before it goes out), each
broadcast (every worker's drafter in use is then read back and compared), each policy sync, and each rollout
(the workers' verify counts before and after). Speculation goes off or on on every worker at once, between
rollouts, through the workers' `set_speculation`."""
from __future__ import annotations

from rlspec.rollout.speculation.drafter_health import DrafterHealth, Fingerprint, HealthConfig, fingerprint


class PoolHealth:
    def __init__(self, cfg: HealthConfig | None = None):
        self.health = DrafterHealth(cfg, backend="ray pool")
        self.speculating = True  # what the workers were last told
        self._sent: tuple[int, Fingerprint] | None = None  # the newest published version and its fingerprint
        self._verified = 0  # the newest version read back from the workers
        self._totals: dict[int, list[int]] = {}  # each worker's counts at the last rollout's end

    def published(self, version: int, state: dict) -> None:
        """A drafter version the pool will hand to the workers (the hub's, a warm start's)."""
        self._sent = (version, fingerprint(state))

    def broadcast(self, call_all) -> None:
        """After a broadcast: read each worker's drafter back once per new version and compare."""
        if self._sent is None or self._sent[0] <= self._verified:
            return
        version, sent = self._sent
        held = call_all("drafter_fingerprint")
        # a worker still on an older version is "not received" too: it was handed this one
        self.health.pushed(version, sent, {f"worker {r}": fp if v == version else {f"(version {v})": (0, 0.0, 0.0, 0.0)}
                                           for r, (v, fp) in held.items()})
        self._verified = version

    def synced(self, policy_version: int) -> None:
        self.health.synced(policy_version)

    def before_rollout(self, call_all) -> None:
        on = self.health.speculate()
        if on != self.speculating:
            call_all("set_speculation", on)
            self.speculating = on
        self._totals = call_all("spec_counts") if not self._totals else self._totals

    def after_rollout(self, call_all) -> None:
        now = call_all("spec_counts")
        delta = [0, 0, 0]
        for r, counts in now.items():
            before = self._totals.get(r, [0, 0, 0])
            delta = [d + c - b for d, c, b in zip(delta, counts, before)]
        self._totals = now
        self.health.observe(*delta)

    def metrics(self) -> dict[str, float]:
        return {**self.health.metrics(), "drafter/health/speculating": float(self.speculating)}
