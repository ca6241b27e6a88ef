"""Rollout metrics: plain counters the engine bumps, turned into slash-named floats by `stats()`."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RolloutMetrics:
    time_s: float = 0.0
    generate_calls: int = 0
    sequences: int = 0
    generated_tokens: int = 0
    completion_lens: list[int] = field(default_factory=list)
    steps: int = 0  # target forwards in decode (each verify counts once)
    spec_steps: int = 0  # of which carried drafts
    drafted: int = 0
    accepted: int = 0
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per verify -> count
    per_drafter: dict = field(default_factory=dict)  # name -> [drafted, accepted, verifies]
    kv_blocks_used: int = 0  # most KV blocks held at once (paged cache, kv_cache.py)
    kv_shared_blocks: int = 0  # block references a prompt's samples shared instead of allocating
    preemptions: int = 0  # sequences that gave their blocks back to make room (scheduler.py)
    # per decode step: (seconds into the call, live batch, tokens emitted, speculated)
    batch_trace: list[tuple[float, int, int, bool]] = field(default_factory=list)

    def record_verify(self, drafter: str, drafted: list[int], accepted: list[int]) -> None:
        self.steps += 1
        if sum(drafted) == 0:
            return
        self.spec_steps += 1
        d = self.per_drafter.setdefault(drafter, [0, 0, 0])
        for n, a in zip(drafted, accepted):
            if n > 0:
                self.drafted += n
                self.accepted += a
                d[0] += n
                d[1] += a
                d[2] += 1
                self.accept_hist[a] += 1

    def as_dict(self) -> dict[str, float]:
        lens = self.completion_lens or [0]
        out = {
            "rollout/time_s": self.time_s,
            "rollout/generated_tokens": float(self.generated_tokens),
            "rollout/tokens_per_s": self.generated_tokens / self.time_s if self.time_s > 0 else 0.0,
            "rollout/num_sequences": float(self.sequences),
            "rollout/mean_len": sum(lens) / len(lens),
            "rollout/max_len": float(max(lens)),
            "rollout/decode_steps": float(self.steps),
            "rollout/spec_step_share": self.spec_steps / self.steps if self.steps else 0.0,
            "rollout/kv_blocks_used": float(self.kv_blocks_used),
            "rollout/kv_shared_blocks": float(self.kv_shared_blocks),
            "rollout/preemptions": float(self.preemptions),
        }
        verifies = sum(self.accept_hist.values())
        if verifies:
            # accepted length counts the token the target emits itself, so 1.0 means "no gain"
            out["rollout/accept_len"] = 1.0 + self.accepted / verifies
            out["rollout/accept_rate"] = self.accepted / max(self.drafted, 1)
            for a, c in sorted(self.accept_hist.items()):
                out[f"rollout/accept_hist/{a}"] = c / verifies
        for name, (n, a, v) in self.per_drafter.items():
            out[f"rollout/accept_rate/{name}"] = a / max(n, 1)
            out[f"rollout/accept_len/{name}"] = 1.0 + a / max(v, 1)
        return out
