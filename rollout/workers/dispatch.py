"""The pool's queue: tasks go to whichever worker is free, so fast workers take more and the tail spreads.

One task in flight per worker: a worker is handed its next task the moment its last one returns
(a pull queue kept on the driver, where it also sees who is idle). Failures:
  - a worker that dies (actor process gone: crash, OOM kill, node lost) or holds stale weights is
    dropped; its task goes back to the front of the queue for the survivors and the worker's own
    error (with its traceback) is logged and kept in `errors`;
  - an exception raised by the engine inside a live worker is retried on another worker up to
    `max_attempts` tries in all, then raised with the worker's traceback (a bug that fails on every
    worker should stop the step, not loop); a ValueError (bad input: a prompt too long for the
    engine, an id outside the vocabulary) is raised at once, as the one engine would raise it
    (Ray's error is then also an instance of the worker's exception class).
No worker left: RolloutWorkerError listing what each one died of (docs/workers.md#failures).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayTaskError

from rollout.workers.tasks import Task

log = logging.getLogger(__name__)


class RolloutWorkerError(RuntimeError):
    """A rollout could not be completed by the pool's workers."""


@dataclass
class DispatchStats:
    tasks_per_worker: dict[int, int] = field(default_factory=dict)
    retried_tasks: int = 0
    lost_workers: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # each worker's own error text, traceback included
    idle_windows: int = 0  # times some worker ran out of tasks while others still worked
    tail_s: float = 0.0  # seconds from the first worker running out of tasks to the call's last result


def run_tasks(workers: dict[int, object], tasks: list[Task], submit: Callable[[int, Task], object],
              on_idle: Callable[[bool], None] = lambda idle: None, on_done: Callable[[int], None] = lambda r: None,
              stats: DispatchStats | None = None, max_attempts: int = 2) -> dict[int, list]:
    """Run every task on `workers` (rank -> actor handle; dead ones are removed from it).

    submit(rank, task) -> ObjectRef of the task's results; on_idle(True) when a worker first finds the
    queue empty while others still work, on_idle(False) when the last result is in; on_done(rank)
    after each successful task (e.g. to pick up new drafter weights). Returns task index -> results.
    """
    stats = stats if stats is not None else DispatchStats()
    queue, free = deque(tasks), list(workers)
    inflight: dict[object, tuple[int, Task]] = {}
    results: dict[int, list] = {}
    attempts: dict[int, int] = {}
    idle, t_idle = False, 0.0
    try:
        while queue or inflight:
            while queue and free:
                rank = free.pop(0)
                task = queue.popleft()
                inflight[submit(rank, task)] = (rank, task)
            if free and not queue and inflight and not idle:
                idle, t_idle = True, time.perf_counter()
                stats.idle_windows += 1
                on_idle(True)
            if not inflight:
                raise RolloutWorkerError(_no_workers(stats))
            (ref,), _ = ray.wait(list(inflight), num_returns=1)
            rank, task = inflight.pop(ref)
            try:
                results[task.index] = ray.get(ref)
            except (RayActorError, RayTaskError) as err:
                _failed(err, rank, task, workers, free, queue, attempts, stats, max_attempts)
                continue
            stats.tasks_per_worker[rank] = stats.tasks_per_worker.get(rank, 0) + 1
            free.append(rank)
            on_done(rank)
    finally:
        if idle:
            stats.tail_s += time.perf_counter() - t_idle
            on_idle(False)
    return results


def _failed(err, rank, task, workers, free, queue, attempts, stats, max_attempts) -> None:
    """Put the task back (front of the queue) and decide whether the worker stays."""
    from rollout.workers.worker import StaleWeightsError

    text = f"rollout worker {rank} failed on task {task.index}:\n{err}"
    stats.errors.append(text)
    lost = isinstance(err, RayActorError) or isinstance(getattr(err, "cause", None), StaleWeightsError)
    if lost:
        workers.pop(rank, None)
        stats.lost_workers.append(rank)
        log.warning("%s\nworker %d is dropped; its task goes to the %d survivors", text, rank, len(workers))
    elif isinstance(err, ValueError):
        raise err
    else:
        attempts[task.index] = attempts.get(task.index, 0) + 1
        if attempts[task.index] >= max_attempts:
            raise RolloutWorkerError(f"task {task.index} failed on {attempts[task.index]} workers; the last "
                                     f"error:\n{err}") from err
        free.append(rank)
        log.warning("%s\nretrying the task on another worker", text)
    if not workers:
        raise RolloutWorkerError(_no_workers(stats))
    stats.retried_tasks += 1
    queue.appendleft(task)


def _no_workers(stats: DispatchStats) -> str:
    return "no rollout worker is left; what they died of:\n" + "\n".join(stats.errors[-4:])
