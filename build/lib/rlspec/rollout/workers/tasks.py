"""A generate call cut into tasks of whole prompt groups, each with its own seed, and put back together.

What the seed promises across workers (docs/workers.md#seeds): task t holds prompts
[t * groups_per_task, (t + 1) * groups_per_task) with all their n samples, and is sampled by one
engine call with seed task_seed(seed, t). Which worker runs a task, how many workers there are and
whether a task was retried after a crash change nothing: with the same prompts, params, weights,
engine settings and groups_per_task the pool returns identical rollouts (under the engine's own
seed promise, rollout/types.py). Task 0 keeps the call's seed, so when one task holds every prompt
the pool returns exactly what a single engine returns for that seed. The engine's sampling stays
as it is (one generator per call): a per-row generator would make results independent of
groups_per_task too, but the rows' logits already depend on the batch they are computed in
(matmul blocking), so bit-exact equality needs equal batches anyway.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from rlspec.rollout.types import RolloutResult, SamplingParams


@dataclass(frozen=True)
class Task:
    """Prompts [first, first + len(prompts)) of a call, sampled with `params` (its own seed)."""

    index: int
    first: int
    prompts: list[list[int]]
    params: SamplingParams


def task_seed(seed: int | None, index: int) -> int | None:
    """Task 0 keeps the call's seed; later tasks get a hash of (seed, index), fixed across runs and
    machines (Python's hash() is salted per process, so not that)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63)


def split(prompts: list[list[int]], params: SamplingParams, groups_per_task: int) -> list[Task]:
    """Tasks of groups_per_task prompts (the last may hold fewer), in prompt order."""
    if groups_per_task < 1:
        raise ValueError(f"groups_per_task must be >= 1, got {groups_per_task}")
    return [Task(t, first, prompts[first:first + groups_per_task], replace(params, seed=task_seed(params.seed, t)))
            for t, first in enumerate(range(0, len(prompts), groups_per_task))]


def merge(tasks: list[Task], results: dict[int, list[RolloutResult]]) -> list[RolloutResult]:
    """Every task's results in task order, prompt_index made global: prompt-major, as one engine returns."""
    out: list[RolloutResult] = []
    for task in tasks:
        got = results[task.index]
        n = task.params.n
        if len(got) != len(task.prompts) * n:
            raise RuntimeError(f"task {task.index} returned {len(got)} results for {len(task.prompts) * n} samples")
        for r in got:
            r.prompt_index += task.first
        out.extend(got)
    return out


def generate_in_tasks(engine, prompts: list[list[int]], params: SamplingParams,
                      groups_per_task: int) -> list[RolloutResult]:
    """What the pool returns, computed by one in-process engine task after task (the reference the
    pool's tests compare with, and a way to check the seed promise without Ray)."""
    tasks = split(prompts, params, groups_per_task)
    return merge(tasks, {t.index: engine.generate(t.prompts, t.params) for t in tasks})
