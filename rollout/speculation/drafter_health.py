"""Drafter health for backends that push a drafter into other processes (the Ray pool, vLLM): is the drafter in
use the one that was sent, and does it still earn its verifies?

Speculation stays lossless whatever the drafter holds (verification keeps the target's law), so a broken drafter
costs speed, silently: a push that dropped a tensor, or acceptance that collapsed after a policy sync moved the
target away from it. `DrafterHealth` watches both, backend-agnostic (plain Python; the backend reports events):
  * `pushed(version, sent, held)`: after each push the backend reads the draft weights in use back; `sent` and
    `held` are fingerprints (numel, sum, sum of squares per tensor in float64, within the dtype's rounding),
    compared by name, or by totals
    where the holder renames or fuses tensors (vLLM fuses q/k/v: a fused tensor's totals are its parts'). A
    mismatch turns speculation off: the drafter in use is not the one trained.
  * `synced(version)`: a policy sync; acceptance is judged afresh from here.
  * `speculate()` before each rollout, `observe(verifies, drafted, accepted)` after it: once `min_verifies`
    verifies back a window and its per-token acceptance is below `floor`, speculation turns off (a warning, and
    `drafter/health/*` metrics); while off, every `probe_every`-th rollout, and the first after a verified push,
    speculates again as a probe, and a probe at or above the floor turns speculation back on.
With `enforce` off (a forced arm) it judges, warns and counts the same, but speculation stays on.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from rlspec.rollout.speculation.ledger import Window

log = logging.getLogger(__name__)

# name -> (numel, sum, sum of squares, the tensor's dtype epsilon: how far rounding alone may move the sums)
Fingerprint = dict[str, tuple[int, float, float, float]]


def fingerprint(named) -> Fingerprint:
    """Per tensor (numel, sum, sum of squares, eps) in float64: `named` is a dict or (name, tensor) pairs."""
    items = named.items() if hasattr(named, "items") else named
    out = {}
    for name, t in items:
        x = t.detach().double()
        eps = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
        out[name] = (x.numel(), float(x.sum()), float((x * x).sum()), eps)
    return out


def totals(fp: Fingerprint) -> tuple[int, float, float, float]:
    return (sum(v[0] for v in fp.values()), sum(v[1] for v in fp.values()), sum(v[2] for v in fp.values()),
            max((v[3] for v in fp.values()), default=0.0))


def compare(sent: Fingerprint, held: Fingerprint, by_name: bool = True) -> list[str]:
    """What differs between the weights sent and those held (empty: the same). The tolerance is the coarser
    side's rounding (a bf16 holder of float32 weights keeps ~3 digits, a float32 one ~7): one optimizer step's
    change to a tensor that did not arrive, or a scrambled one, moves the sums past it."""
    if not by_name:
        sent, held = {"(all tensors)": totals(sent)}, {"(all tensors)": totals(held)}
    problems = [f"{n}: sent, not held" for n in sent if n not in held]
    problems += [f"{n}: held, not sent" for n in held if n not in sent]
    for n in sent.keys() & held.keys():
        (n1, s1, q1, e1), (n2, s2, q2, e2) = sent[n], held[n]
        rtol = 4 * max(e1, e2)
        if n1 != n2:
            problems.append(f"{n}: {n1} values sent, {n2} held")
        elif not math.isclose(q1, q2, rel_tol=rtol, abs_tol=1e-12) or \
                not math.isclose(s1, s2, rel_tol=rtol, abs_tol=rtol * math.sqrt(q1 * n1) + 1e-12):
            problems.append(f"{n}: values differ (sum {s1:.6g} sent, {s2:.6g} held)")
    return sorted(problems)


@dataclass
class HealthConfig:
    # per-token acceptance below which a drafter is not worth its verifies: a drafter trained on its target
    # accepts 0.3-0.8 per token, an untrained or scrambled one about 1/vocabulary
    floor: float = 0.05
    min_verifies: int = 64  # verifies (drafted steps of a row) a verdict rests on
    probe_every: int = 4  # rollouts between probes while speculation is off
    # False: judge, warn and count, but never turn speculation off (a forced arm, selector "always", speculates
    # whatever it costs: benchmarks and tests that must compare speculative rollouts)
    enforce: bool = True


class DrafterHealth:
    def __init__(self, cfg: HealthConfig | None = None, backend: str = "backend"):
        self.cfg, self.backend = cfg or HealthConfig(), backend
        self.on, self.reason, self.probing = True, None, False
        self._event = "the start"
        self._window = Window()  # the backend's verifies since the last verdict or event (the ledger's record type)
        self._rollouts_off = 0
        self._probe_due = False
        self.counts = {"turned_off": 0, "recovered": 0, "bad_pushes": 0, "probes": 0}
        self.last_accept: float | None = None

    # ---- events the backend reports --------------------------------------------------------------
    def pushed(self, version: int, sent: Fingerprint, held: dict[str, Fingerprint], by_name: bool = True) -> bool:
        """A push of drafter `version`: `held` maps each holder (a worker, vLLM) to what it reads back."""
        bad = {who: p for who, fp in held.items() if (p := compare(sent, fp, by_name))}
        if bad:
            self.counts["bad_pushes"] += 1
            detail = "; ".join(f"{who}: {', '.join(p[:3])}" for who, p in sorted(bad.items()))
            self._turn_off(f"drafter v{version} was not received intact ({detail})")
            return False
        self._event = f"drafter push v{version}"
        self._window = Window()
        self._probe_due = not self.on  # a fresh drafter: try it at the next rollout
        return True

    def synced(self, policy_version: int) -> None:
        self._event = f"policy sync v{policy_version}"
        self._window = Window()

    def speculate(self) -> bool:
        """Whether the next rollout speculates (a probe while off; always, where the config does not enforce)."""
        if self.on:
            return True
        self._rollouts_off += 1
        if self._probe_due or self._rollouts_off % self.cfg.probe_every == 0:
            self._probe_due, self.probing = False, True
            self.counts["probes"] += 1
            self._window = Window()
        return self.probing or not self.cfg.enforce

    def observe(self, verifies: int, drafted: int, accepted: int) -> None:
        """The last rollout's speculation: verifies, drafted tokens, accepted tokens."""
        w = self._window
        w.add(verifies, drafted, accepted)
        if w.verifies < self.cfg.min_verifies or w.drafted == 0:
            return  # a probe too short to judge stays open for the next rollout
        rate = w.accepted / w.drafted
        self.last_accept = rate
        n = w.verifies
        self._window = Window()
        if self.probing:
            self.probing = False
            if rate >= self.cfg.floor:
                self.on, self.reason = True, None
                self.counts["recovered"] += 1
                log.warning("%s: speculation back on: a probe accepted %.3f per drafted token over %d verifies",
                            self.backend, rate, n)
        elif self.on and rate < self.cfg.floor:
            self._turn_off(f"acceptance {rate:.3f} per drafted token over {n} verifies since {self._event}, "
                           f"below the floor {self.cfg.floor}")

    # ---- reading it ------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out = {"drafter/health/ok": float(self.on), **{f"drafter/health/{k}": float(v) for k, v in self.counts.items()}}
        if self.last_accept is not None:
            out["drafter/health/window_accept"] = self.last_accept
        return out

    def _turn_off(self, why: str) -> None:
        if self.on:
            self.counts["turned_off"] += 1
        self.on, self.probing, self.reason, self._rollouts_off = False, False, why, 0
        if not self.cfg.enforce:
            log.warning("%s: drafter unhealthy (%s); speculation stays on: its arm is forced", self.backend, why)
            return
        log.warning("%s: speculation off: %s; a probe every %d rollouts (or after the next verified push) turns "
                    "it back on when a drafter recovers", self.backend, why, self.cfg.probe_every)
