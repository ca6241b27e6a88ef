"""Per-sample random keys: the name the engine draws a sample's tokens from (docs/verification.md#per-sample-keys).

A GRPO sample is named by the run's seed, the process, its group's place in the run's sequence of groups (the
order TRL's sampler hands prompts out) and its index in the group. With keys the engine draws each token from the
sample's name and position alone, so runs that batch the same sample differently (partial rollouts on or off,
another batch size, a preemption) draw it alike from the same policy: they differ by what they change, not by luck.
"""
from __future__ import annotations

import hashlib


def sample_key(seed: int, process: int, group: int, sample: int) -> int:
    """A key in [0, 2**62) for sample `sample` of group `group` (its ordinal in the run) on process `process`."""
    digest = hashlib.blake2b(f"{seed}/{process}/{group}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def sample_keys(seed: int, process: int, names: list[tuple[int, int]]) -> list[int]:
    """The keys of samples named (group ordinal, index in the group), in the order given (the engine's results)."""
    return [sample_key(seed, process, group, sample) for group, sample in names]
