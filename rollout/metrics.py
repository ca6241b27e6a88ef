"""Rollout metrics: plain counters the engine bumps, turned into slash-named floats by `stats()`, and the
names every backend (engine, Ray pool, vLLM), both trainers and the run's summary share: one definition
each below, so no reader of a metric can be left behind by a rename. What speculation cost and saved (plain step
time, drafting cost and acceptance per drafter, seconds saved) is read from the speculation ledger's window
(rollout/speculation/ledger.py) by `ledger_metrics`, not counted here a second time."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

TIME_S = "rollout/time_s"  # seconds inside generate (the Ray pool: the call's wall time)
GENERATED_TOKENS = "rollout/generated_tokens"  # completion tokens
TOKENS_PER_S = "rollout/tokens_per_s"  # GENERATED_TOKENS / TIME_S
NUM_SEQUENCES = "rollout/num_sequences"  # samples returned
MEAN_LEN = "rollout/mean_len"  # mean completion length
MAX_LEN = "rollout/max_len"  # longest completion
DECODE_STEPS = "rollout/decode_steps"  # target forwards in decode
SPEC_STEP_SHARE = "rollout/spec_step_share"  # share of them that carried drafts
# share of them launched before the host read the step in front (a look-ahead, rollout/decode.py, chains_ahead.py):
# on a GPU the steps the device did not wait for the host before
AHEAD_SHARE = "rollout/ahead_share"
KV_BLOCKS_USED = "rollout/kv_blocks_used"  # most KV blocks held at once
KV_SHARED_BLOCKS = "rollout/kv_shared_blocks"  # block references shared instead of allocated
PREEMPTIONS = "rollout/preemptions"  # sequences that gave their blocks back
ACCEPT_LEN = "rollout/accept_len"  # tokens per verify, the target's own included (1 = no gain)
ACCEPT_RATE = "rollout/accept_rate"  # accepted / drafted
POLICY_VERSION = "rollout/policy_version"  # load_weights calls taken
KV_CACHE_MB = "rollout/kv_cache_mb"  # the KV pool's size
KV_BLOCKS_TOTAL = "rollout/kv_blocks_total"  # the KV pool's blocks at the end of the call
GRAPH_POOL_MB = "rollout/graph_pool_mb"  # CUDA graph memory
WALL_S = "rollout/wall_s"  # a trainer's rollout, weight sync included
PLAIN_STEP_MS = "rollout/plain_step_ms"  # mean time of a decode step no row drafted in (forward to commit)
DRAFT_MS_PER_TOKEN = "rollout/draft_ms_per_token"  # /<drafter>: proposing time per drafted token (rows summed)
DRAFT_LEVEL_MS = "rollout/draft_level_ms"  # /<drafter>: one draft level for the whole live batch
# /<drafter>: one draft level for the whole live batch over a plain step at that live batch (mean over levels):
# a verify of k drafts pays k times this beside the verify itself (docs/gpu.md#predicted-rollout-speedup)
DRAFT_COST = "rollout/draft_cost"
# decode seconds speculation saved (< 0: lost) against plain steps at the same live batch (the ledger's S)
SPEC_SAVED_S = "rollout/spec_saved_s"


@dataclass
class RolloutMetrics:
    time_s: float = 0.0
    generate_calls: int = 0
    sequences: int = 0
    generated_tokens: int = 0
    completion_lens: list[int] = field(default_factory=list)
    steps: int = 0  # target forwards in decode (each verify counts once)
    spec_steps: int = 0  # of which carried drafts
    ahead_steps: int = 0  # of which were launched before the host read the step in front
    drafted: int = 0
    accepted: int = 0
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per verify -> count
    kv_blocks_used: int = 0  # most KV blocks held at once (paged cache, kv_cache.py)
    kv_shared_blocks: int = 0  # block references a prompt's samples shared instead of allocating
    preemptions: int = 0  # sequences that gave their blocks back to make room (scheduler.py)
    # per decode step: (seconds into the call, live batch, tokens emitted, speculated)
    batch_trace: list[tuple[float, int, int, bool]] = field(default_factory=list)

    def record_call(self, seqs, seconds: float, blocks, preemptions: int) -> None:
        """A finished generate call: its sequences, wall time, the block allocator's stats, preemptions."""
        self.kv_blocks_used = max(self.kv_blocks_used, blocks.peak_used)
        self.kv_shared_blocks += blocks.shared_refs
        self.preemptions += preemptions
        self.time_s += seconds
        self.generate_calls += 1
        self.sequences += len(seqs)
        self.generated_tokens += sum(len(s.completion_ids) - s.carried for s in seqs)
        self.completion_lens.extend(len(s.completion_ids) for s in seqs)

    def record_verify(self, drafter: str, drafted: list[int], accepted: list[int], ahead: bool = False) -> None:
        """One decode step: its drafts and their acceptance per row, and whether it was launched ahead (its seconds
        are the ledger's to keep: rollout/speculation/ledger.py)."""
        self.steps += 1
        self.ahead_steps += ahead
        if sum(drafted) == 0:
            return
        self.spec_steps += 1
        for n, a in zip(drafted, accepted):
            if n > 0:
                self.drafted += n
                self.accepted += a
                self.accept_hist[a] += 1

    def as_dict(self) -> dict[str, float]:
        lens = self.completion_lens or [0]
        out = {
            TIME_S: self.time_s,
            GENERATED_TOKENS: float(self.generated_tokens),
            TOKENS_PER_S: self.generated_tokens / self.time_s if self.time_s > 0 else 0.0,
            NUM_SEQUENCES: float(self.sequences),
            MEAN_LEN: sum(lens) / len(lens),
            MAX_LEN: float(max(lens)),
            DECODE_STEPS: float(self.steps),
            SPEC_STEP_SHARE: self.spec_steps / self.steps if self.steps else 0.0,
            AHEAD_SHARE: self.ahead_steps / self.steps if self.steps else 0.0,
            KV_BLOCKS_USED: float(self.kv_blocks_used),
            KV_SHARED_BLOCKS: float(self.kv_shared_blocks),
            PREEMPTIONS: float(self.preemptions),
        }
        verifies = sum(self.accept_hist.values())
        if verifies:
            # accepted length counts the token the target emits itself, so 1.0 means "no gain"
            out[ACCEPT_LEN] = 1.0 + self.accepted / verifies
            out[ACCEPT_RATE] = self.accepted / max(self.drafted, 1)
            for a, c in sorted(self.accept_hist.items()):
                out[f"rollout/accept_hist/{a}"] = c / verifies
        return out


def ledger_metrics(window: dict) -> dict[str, float]:
    """The speculation ledger's window (Ledger.take_window) as rollout metrics: PLAIN_STEP_MS, SPEC_SAVED_S, and
    per drafter accept_rate, accept_len, DRAFT_MS_PER_TOKEN, DRAFT_LEVEL_MS and DRAFT_COST."""
    out = {}
    plain_ms = window["plain_s"] / window["plain_steps"] * 1e3 if window["plain_steps"] else None
    if plain_ms is not None:
        out[PLAIN_STEP_MS] = plain_ms
    if window["saved_s"] is not None:
        out[SPEC_SAVED_S] = window["saved_s"]
    for name, w in window["drafters"].items():
        out[f"{ACCEPT_RATE}/{name}"] = w.accepted / max(w.drafted, 1)
        out[f"{ACCEPT_LEN}/{name}"] = 1.0 + w.accepted / max(w.verifies, 1)
        if w.timed_drafted:
            out[f"{DRAFT_MS_PER_TOKEN}/{name}"] = w.draft_s / w.timed_drafted * 1e3
        if w.levels:
            out[f"{DRAFT_LEVEL_MS}/{name}"] = w.draft_s / w.levels * 1e3
        if w.costed_levels:
            out[f"{DRAFT_COST}/{name}"] = w.level_steps / w.costed_levels
    return out
