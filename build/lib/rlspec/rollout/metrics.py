"""Rollout metrics: plain counters the engine bumps, turned into slash-named floats by `stats()`, and the
names every backend (engine, Ray pool, vLLM), both trainers and the run's summary share: one definition
each below, so no reader of a metric can be left behind by a rename."""
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
PLAIN_STEP_MS = "rollout/plain_step_ms"  # mean time of a decode step that carried no drafts (forward to commit)
DRAFT_MS_PER_TOKEN = "rollout/draft_ms_per_token"  # /<drafter>: proposing time per drafted token (rows summed)
DRAFT_LEVEL_MS = "rollout/draft_level_ms"  # /<drafter>: one draft level for the whole live batch
# /<drafter>: one draft level for the whole live batch over a plain step at that batch, the mean over the batch
# buckets drafted in weighted by their levels; /<drafter>/b<bucket>: per live-batch bucket. What a verify of k
# drafts pays beside the verify itself: k times this, in plain steps (docs/gpu.md#predicted-rollout-speedup)
DRAFT_COST = "rollout/draft_cost"
# decode seconds speculation saved (< 0: lost) against plain steps at the same live batch (spec_saved_s below)
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
    drafted: int = 0
    accepted: int = 0
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per verify -> count
    per_drafter: dict = field(default_factory=dict)  # name -> [drafted, accepted, verifies, draft seconds]
    draft_levels: dict = field(default_factory=dict)  # (name, live-batch bucket) -> [draft levels, their seconds]
    plain_steps: int = 0  # timed steps without drafts
    plain_seconds: float = 0.0  # and their seconds
    kv_blocks_used: int = 0  # most KV blocks held at once (paged cache, kv_cache.py)
    kv_shared_blocks: int = 0  # block references a prompt's samples shared instead of allocating
    preemptions: int = 0  # sequences that gave their blocks back to make room (scheduler.py)
    # per decode step: (seconds into the call, live batch, tokens emitted, speculated)
    batch_trace: list[tuple[float, int, int, bool]] = field(default_factory=list)
    plain_by_bucket: dict = field(default_factory=dict)  # live-batch bucket -> [plain steps, their seconds]
    spec_by_bucket: dict = field(default_factory=dict)  # bucket -> [rows advanced (emitted / live), seconds]

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

    def record_verify(self, drafter: str, drafted: list[int], accepted: list[int], draft_s: float = 0.0,
                      step_s: float | None = 0.0, levels: int | None = None) -> None:
        """One decode step: its drafts and their acceptance per row, the seconds spent proposing (draft_s) and
        in the rest of the step (step_s: forward, verify, transfer, commit; None when the step compiled its
        shape first, which is no step's cost); levels: the draft levels the proposal ran for the whole batch
        (the arm's depth; default the longest row's draft, a chain's depth)."""
        self.steps += 1
        bucket = bucket_of(len(drafted))
        if sum(drafted) == 0:
            if step_s is not None:
                self.plain_steps += 1
                self.plain_seconds += step_s
                _add(self.plain_by_bucket, bucket, 1, step_s)
            return
        self.spec_steps += 1
        if step_s is not None:  # positions the batch advanced: a plain step advances each row by one
            _add(self.spec_by_bucket, bucket, (sum(accepted) + len(drafted)) / len(drafted), step_s + draft_s)
        d = self.per_drafter.setdefault(drafter, [0, 0, 0, 0.0])
        d[3] += draft_s
        if step_s is not None:  # a step that compiled or captured first is no measure of a level's cost
            _add(self.draft_levels, (drafter, bucket), levels or max(drafted), draft_s)
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
            TIME_S: self.time_s,
            GENERATED_TOKENS: float(self.generated_tokens),
            TOKENS_PER_S: self.generated_tokens / self.time_s if self.time_s > 0 else 0.0,
            NUM_SEQUENCES: float(self.sequences),
            MEAN_LEN: sum(lens) / len(lens),
            MAX_LEN: float(max(lens)),
            DECODE_STEPS: float(self.steps),
            SPEC_STEP_SHARE: self.spec_steps / self.steps if self.steps else 0.0,
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
        plain_ms = self.plain_seconds / self.plain_steps * 1e3 if self.plain_steps else None
        if plain_ms is not None:
            out[PLAIN_STEP_MS] = plain_ms
        saved = self.spec_saved_s()
        if saved is not None:
            out[SPEC_SAVED_S] = saved
        for name, (n, a, v, secs) in self.per_drafter.items():
            out[f"rollout/accept_rate/{name}"] = a / max(n, 1)
            out[f"rollout/accept_len/{name}"] = 1.0 + a / max(v, 1)
            if n:
                out[f"{DRAFT_MS_PER_TOKEN}/{name}"] = secs / n * 1e3
        out.update(self.draft_costs())
        return out

    def draft_costs(self) -> dict[str, float]:
        """DRAFT_LEVEL_MS and DRAFT_COST per drafter (and per live-batch bucket): a level's seconds at each bucket
        over the plain step at that bucket (the nearest bucket with plain steps where it has none)."""
        out, per = {}, {}
        for (name, bucket), (levels, seconds) in sorted(self.draft_levels.items()):
            total = per.setdefault(name, [0.0, 0.0, 0.0, 0.0])  # levels, seconds, costed levels, cost x levels
            total[0] += levels
            total[1] += seconds
            plain = self._plain_s(bucket)
            if plain and levels:
                out[f"{DRAFT_COST}/{name}/b{bucket}"] = seconds / levels / plain
                total[2] += levels
                total[3] += seconds / plain
        for name, (levels, seconds, costed, weighted) in per.items():
            if levels:
                out[f"{DRAFT_LEVEL_MS}/{name}"] = seconds / levels * 1e3
            if costed:
                out[f"{DRAFT_COST}/{name}"] = weighted / costed
        return out

    def _plain_s(self, bucket: int) -> float | None:
        """Seconds of a plain step at this live-batch bucket, or at the nearest bucket with plain steps."""
        if not self.plain_by_bucket:
            return None
        near = min(self.plain_by_bucket, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        steps, seconds = self.plain_by_bucket[near]
        return seconds / steps if steps else None

    def spec_saved_s(self) -> float | None:
        """Decode seconds speculation saved (negative: lost): for each live-batch bucket, the plain steps its
        speculative steps replaced (rows advanced, each row's accepted drafts plus its own token) at the bucket's
        measured plain step time, minus what those steps took with drafting. A bucket without plain steps borrows
        the nearest bucket's time. An estimate (a plain step's cost moves with the context length too); None
        without speculative steps or without any plain step to compare with."""
        if not self.spec_by_bucket or not self.plain_by_bucket:
            return None
        return sum(advanced * self._plain_s(bucket) - seconds for bucket, (advanced, seconds) in self.spec_by_bucket.items())


def bucket_of(rows: int) -> int:
    """The power of two at or above `rows` (a plain step's cost grows slowly with rows within one)."""
    return 1 << max(rows - 1, 0).bit_length()


def _add(table: dict, key: int, count: float, seconds: float) -> None:
    entry = table.setdefault(key, [0.0, 0.0])
    entry[0] += count
    entry[1] += seconds
