"""Reading vLLM's draft model back after a drafter push (drafter health, rollout/speculation/drafter_health.py).

vLLM's draft model names and fuses what the export sends (q/k/v into one tensor, gate/up into one), so the
comparison is by totals (numel, sum, sum of squares: a fused tensor's totals are its parts'). It may also hold
tensors the export does not send (an embedding of its own, buffers of its layout): their totals do not change
between pushes, so they are measured once, against the drafter vLLM started with, and taken off every later
reading. Totals within bf16's rounding catch gross faults (a tensor missing or of another size, random or
re-initialised weights, a stale tensor of another drafter), not a tensor one optimizer step behind. Tensors
shared with the target (vLLM's EAGLE-3 reuses the target's embedding where the export has none)
are left out: a policy sync moves them."""
from __future__ import annotations

from rlspec.rollout.speculation.drafter_health import Fingerprint, fingerprint, totals


def _draft_fingerprint(worker) -> Fingerprint:
    """On vLLM's worker: fingerprint of the draft model's parameters that the target model does not share."""
    runner = worker.model_runner
    shared = {p.data_ptr() for p in runner.get_model().parameters()}
    draft = runner.get_draft_model()
    return fingerprint({n: p for n, p in draft.named_parameters() if p.data_ptr() not in shared})


def read(llm) -> Fingerprint:
    return llm.collective_rpc(_draft_fingerprint)[0]


class DraftReadback:
    """What vLLM's draft model holds beyond the pushed tensors, measured once at start (`started_with`: the
    tensors of the drafter vLLM loaded), then taken off each reading."""

    def __init__(self, llm, started_with: dict):
        held, sent = totals(read(llm)), totals(fingerprint(started_with))
        self.extra = tuple(h - s for h, s in zip(held[:3], sent[:3]))

    def held(self, llm) -> Fingerprint:
        """One-entry fingerprint of the drafter vLLM now drafts with, comparable to the pushed tensors' totals."""
        n, s, q, eps = totals(read(llm))
        return {"(draft model)": (n - int(self.extra[0]), s - self.extra[1], q - self.extra[2], eps)}
