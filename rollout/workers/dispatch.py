"""The pool's queue: tasks go to whichever worker is free, so fast workers take more and the tail spreads.

One task in flight per worker: a worker is handed its next task the moment its last one returns
(a pull queue kept on the driver, where it also sees who is idle). Failures:
  - a worker that dies (actor process gone: crash, OOM kill, node lost) or holds stale weights is
    dropped and killed (ray.kill: a dropped actor never lingers holding its CPU/GPU); its task goes
    back to the front of the queue for the survivors and the worker's own error (with its
    traceback) is logged and kept in `errors`;
  - an exception raised by the engine inside a live worker is retried on another worker; a
    ValueError (bad input: a prompt too long for the engine, an id outside the vocabulary) is raised
    at once, as the one engine would raise it (Ray's error is then also an instance of the worker's
    exception class);
  - either way a task is retried at most `max_task_retries` times (rollout.max_task_retries), then
    RolloutWorkerError is raised with the last error: a task that kills every worker it lands on
    (out of memory on a huge prompt) must stop the step, not take down the whole pool one worker at
    a time, and a bug that fails on every worker must not loop.
  - a worker alive but stuck (a hung driver call, a deadlock, a node that stopped answering) is caught by a
    per-task deadline (TaskDeadline: a stated multiple of the slowest recent task, never below a floor): it
    is dropped and killed like a dead one and its task re-run elsewhere, the same Task (the same sample
    keys), so the same samples;
  - a dropped worker is replaced when the caller can (`replace`), so the pool keeps its size.
The calls every worker answers between rollouts (a policy sync, a drafter broadcast, stats: `call_all`) have
the same deadline: a worker still in one past it is dropped as stuck and replaced, and the call made on the
replacement.
No worker left: RolloutBackendLost listing what each one died of. While waiting, `check()` runs
every `poll_s` (the pool's ClusterWatch: a lost Ray head raises instead of hanging). docs/workers.md#failures.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayTaskError

from rlspec.rollout.errors import RolloutBackendLost, RolloutWorkerError
from rlspec.rollout.workers.tasks import Task

log = logging.getLogger(__name__)

__all__ = ["DispatchStats", "RolloutWorkerError", "TaskDeadline", "WorkerStuck", "call_all", "drop_worker", "kill_actor",
           "kill_and_wait", "run_tasks"]


@dataclass
class TaskDeadline:
    """How long one task may run: `multiple` x the slowest of the last `window` tasks' times, at least `floor_s`;
    before any task was measured (the first rollout compiles and warms up), `first_s`."""

    multiple: float = 5.0
    floor_s: float = 30.0
    first_s: float = 300.0
    window: int = 32
    recent: deque = field(default_factory=deque)

    def __post_init__(self):
        if not (self.multiple >= 1 and self.floor_s > 0 and self.first_s > 0):
            raise ValueError(f"task deadline: multiple must be >= 1 and floor_s, first_s > 0, got {self}")

    def limit_s(self) -> float:
        if not self.recent:
            return max(self.first_s, self.floor_s)
        return max(self.floor_s, self.multiple * max(self.recent))

    def measured(self, seconds: float) -> None:
        self.recent.append(seconds)
        while len(self.recent) > self.window:
            self.recent.popleft()


class WorkerStuck(RuntimeError):
    """A task ran past its deadline on a live worker."""


@dataclass
class DispatchStats:
    tasks_per_worker: dict[int, int] = field(default_factory=dict)
    retried_tasks: int = 0
    lost_workers: list[int] = field(default_factory=list)
    stuck_workers: list[int] = field(default_factory=list)  # dropped for running a task past its deadline
    replaced_workers: int = 0
    errors: list[str] = field(default_factory=list)  # each worker's own error text, traceback included
    idle_windows: int = 0  # times some worker ran out of tasks while others still worked
    tail_s: float = 0.0  # seconds from the first worker running out of tasks to the call's last result


def run_tasks(workers: dict[int, object], tasks: list[Task], submit: Callable[[int, Task], object],
              on_idle: Callable[[bool], None] = lambda idle: None, on_done: Callable[[int], None] = lambda r: None,
              stats: DispatchStats | None = None, max_task_retries: int = 2,
              check: Callable[[], None] = lambda: None, poll_s: float = 1.0, deadline: TaskDeadline | None = None,
              replace: Callable[[], int | None] | None = None) -> dict[int, list]:
    """Run every task on `workers` (rank -> actor handle; dropped ones are killed and removed from it).

    submit(rank, task) -> ObjectRef of the task's results; on_idle(True) when a worker first finds the
    queue empty while others still work, on_idle(False) when the last result is in; on_done(rank)
    after each successful task (e.g. to pick up new drafter weights); check() every poll_s while
    waiting (raises to abandon the call); deadline: how long one task may run (None: no limit), each
    finished task's time measured into it; replace() after a worker is dropped: starts another, adds it to
    `workers` and returns its rank (None when it cannot). Returns task index -> results.
    """
    if max_task_retries < 0:
        raise ValueError(f"max_task_retries must be >= 0, got {max_task_retries}")
    stats = stats if stats is not None else DispatchStats()
    queue, free = deque(tasks), list(workers)
    inflight: dict[object, tuple[int, Task, float]] = {}
    results: dict[int, list] = {}
    failures: dict[int, list[int]] = {}  # task index -> ranks it failed on
    idle, t_idle = False, 0.0

    def lost(rank: int, task: Task, err: BaseException) -> None:
        _failed(err, rank, task, workers, free, failures, stats, max_task_retries, replace)
        queue.appendleft(task)

    try:
        while queue or inflight:
            while queue and free:
                rank = free.pop(0)
                task = queue.popleft()
                inflight[submit(rank, task)] = (rank, task, time.monotonic())
            if free and not queue and inflight and not idle:
                idle, t_idle = True, time.perf_counter()
                stats.idle_windows += 1
                on_idle(True)
            if not inflight:
                raise RolloutBackendLost(_no_workers(stats))
            wait = poll_s if deadline is None else min(poll_s, max(_next_due(inflight, deadline), 0.01))
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=wait)
            if not ready:
                for ref in _overdue(inflight, deadline):
                    rank, task, t0 = inflight.pop(ref)
                    lost(rank, task, WorkerStuck(
                        f"task {task.index} ran {time.monotonic() - t0:.0f} s on a live worker, past its deadline of "
                        f"{deadline.limit_s():.0f} s ({deadline.multiple:g} x the slowest recent task, at least "
                        f"{deadline.floor_s:g} s): the worker is stuck"))
                check()
                continue
            rank, task, t0 = inflight.pop(ready[0])
            try:
                results[task.index] = ray.get(ready[0])
            except (RayActorError, RayTaskError) as err:
                lost(rank, task, err)
                continue
            if deadline is not None:
                deadline.measured(time.monotonic() - t0)
            stats.tasks_per_worker[rank] = stats.tasks_per_worker.get(rank, 0) + 1
            free.append(rank)
            on_done(rank)
    finally:
        if idle:
            stats.tail_s += time.perf_counter() - t_idle
            on_idle(False)
    return results


def call_all(workers: dict[int, object], method: str, args: tuple = (), *, stats: DispatchStats,
             deadline: TaskDeadline | None = None, replace: Callable[[], int | None] | None = None,
             check: Callable[[], None] = lambda: None, poll_s: float = 1.0) -> dict[int, object]:
    """method(*args) on every worker, each answer waited for; returns rank -> answer.

    A dead worker is dropped (killed, its error kept in stats.errors). One still in the call past the deadline
    (deadline.limit_s() from when the call went out: the rollout tasks' own measure) is dropped as stuck; with
    replace() a new worker takes its place (holding the current policy: replace's job) and is asked the same, once:
    stuck again, it is dropped too. An exception the method raises in a live worker is raised here. check() runs
    every poll_s while waiting (a lost Ray head raises instead of hanging). No worker left: RolloutBackendLost."""
    # ref -> (rank, whether it is a replacement, when the call went out): t0 last, as run_tasks keeps its tasks
    pending = {getattr(w, method).remote(*args): (r, False, time.monotonic()) for r, w in workers.items()}
    out: dict[int, object] = {}
    while pending:
        wait = poll_s if deadline is None else min(poll_s, max(_next_due(pending, deadline), 0.01))
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait)
        for ref in ready:
            rank, _, _ = pending.pop(ref)
            try:
                out[rank] = ray.get(ref)
            except RayActorError as err:
                stats.errors.append(f"rollout worker {rank} failed on {method}:\n{err}")
                drop_worker(workers, rank, stats, stats.errors[-1])
        for ref in _overdue(pending, deadline):
            rank, replaced, t0 = pending.pop(ref)
            stats.errors.append(f"rollout worker {rank} did not answer {method} within {time.monotonic() - t0:.0f} s, "
                                f"past its deadline of {deadline.limit_s():.0f} s ({deadline.multiple:g} x the slowest "
                                f"recent task, at least {deadline.floor_s:g} s): the worker is stuck")
            stats.stuck_workers.append(rank)
            drop_worker(workers, rank, stats, stats.errors[-1])
            new = replace() if replace is not None and not replaced else None
            if new is not None:
                stats.replaced_workers += 1
                log.warning("worker %d replaces the dropped worker %d", new, rank)
                pending[getattr(workers[new], method).remote(*args)] = (new, True, time.monotonic())
        if pending:
            check()
    if not workers:
        raise RolloutBackendLost(f"no rollout worker is left (while calling {method}); what they died of:\n"
                                 + "\n".join(stats.errors[-4:]))
    return out


def _next_due(inflight: dict, deadline: TaskDeadline) -> float:
    """Seconds until the first task in flight passes its deadline."""
    limit, now = deadline.limit_s(), time.monotonic()
    return min(t0 + limit - now for _, _, t0 in inflight.values())


def _overdue(inflight: dict, deadline: TaskDeadline | None) -> list:
    if deadline is None:
        return []
    limit, now = deadline.limit_s(), time.monotonic()
    return [ref for ref, (_, _, t0) in inflight.items() if now - t0 > limit]


def _failed(err, rank, task, workers, free, failures, stats, max_task_retries, replace=None) -> None:
    """Decide whether the worker stays and whether the task may go back to the queue (else raise)."""
    from rlspec.rollout.workers.worker import StaleWeightsError

    text = f"rollout worker {rank} failed on task {task.index}:\n{err}"
    stats.errors.append(text)
    stuck = isinstance(err, WorkerStuck)
    lost = stuck or isinstance(err, RayActorError) or isinstance(getattr(err, "cause", None), StaleWeightsError)
    if not lost and isinstance(err, ValueError):
        raise err
    if lost:
        if stuck:
            stats.stuck_workers.append(rank)
        drop_worker(workers, rank, stats, text)
        new = replace() if replace is not None else None
        if new is not None:
            stats.replaced_workers += 1
            free.append(new)
            log.warning("worker %d replaces the dropped worker %d", new, rank)
    else:
        free.append(rank)
    if not workers:
        raise RolloutBackendLost(_no_workers(stats))
    ranks = failures.setdefault(task.index, [])
    ranks.append(rank)
    if len(ranks) > max_task_retries:
        raise RolloutWorkerError(
            f"task {task.index} failed {len(ranks)} times (on workers {ranks}); rollout.max_task_retries="
            f"{max_task_retries} allows {max_task_retries} retries. A task that fails or kills every worker it "
            "lands on (a prompt that runs a worker out of memory, a bug) stops the step here instead of taking "
            "the pool down; raise rollout.max_task_retries if the failures are transient. The last error:\n"
            f"{err}") from err
    stats.retried_tasks += 1
    log.warning("%s\nretrying the task on another worker (retry %d of %d)", text, len(ranks), max_task_retries)


def drop_worker(workers: dict[int, object], rank: int, stats: DispatchStats, why: str) -> None:
    """Remove worker `rank` from the pool and kill its actor: one that is alive but out of step (stale
    weights, an unavailable node coming back) must not hold its CPU/GPU or answer later."""
    actor = workers.pop(rank, None)
    if actor is None:
        return
    stats.lost_workers.append(rank)
    kill_actor(actor)
    log.warning("%s\nworker %d is dropped and killed; %d workers remain", why, rank, len(workers))


def kill_actor(actor) -> None:
    """ray.kill without restarts; an actor already gone (or a cluster already down) is not an error here."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception as err:  # noqa: BLE001 - killing the dead fails in several ways, all harmless
        log.debug("ray.kill of a dropped actor: %s", err)


def kill_and_wait(actors: list, timeout_s: float = 10.0) -> None:
    """Kill every actor and return once each is gone (or timeout_s has passed). ray.kill only sends the kill, so a
    call submitted right after it can still reach the actor: twice in full-suite runs a worker answered a call
    made after close() (test_pool.py::test_a_dead_drafter_trainer_is_backend_lost_and_close_still_kills_every_
    actor), and a closed pool may hold its CPUs/GPUs a moment longer than its caller believes."""
    for actor in actors:
        kill_actor(actor)
    deadline = time.monotonic() + timeout_s
    for actor in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(), 0.01))
            except Exception:  # noqa: BLE001 - RayActorError (gone), a cluster already down, the deadline: done
                break
            time.sleep(0.05)


def _no_workers(stats: DispatchStats) -> str:
    return "no rollout worker is left; what they died of:\n" + "\n".join(stats.errors[-4:])
