"""RayPool: the "ray" rollout backend, N RolloutEngine replicas as Ray actors behind one RolloutBackend.

One worker per GPU on GPU clusters; on CPUs one per core, each with one torch thread. A generate
call is cut into tasks of whole prompt groups (tasks.py: what a seed promises), the tasks go to
whichever worker is free (dispatch.py: crashes retried on the survivors) and the results come back
prompt-major, as from one engine. Policy weights reach the workers once per sync: one ray.put, every
worker reads the same object, and every task names the policy version it must be sampled from.
With a learned drafter the run has one DrafterHub (spot.py) that every worker's features feed and
whose versions the pool hands to every worker between tasks. docs/workers.md has the design.
Faults (docs/distributed.md#ray-faults): a dropped worker is killed, a task is retried at most
max_task_retries times, and a lost Ray head or drafter trainer raises RolloutBackendLost (a trainer
saves its checkpoint on it); close() kills every actor whatever fails first and never raises.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace

import ray
import torch

import rlspec.rollout.metrics as M
from rlspec.rollout.eos import resolve_eos
from rlspec.rollout.runtime.model.families import family_of_model
from rlspec.rollout.types import RolloutResult, SamplingParams, SpecConfig
from rlspec.rollout.workers import cluster
from rlspec.rollout.workers.dispatch import DispatchStats, TaskDeadline, call_all, kill_and_wait, run_tasks
from rlspec.rollout.speculation.drafter_health import HealthConfig
from rlspec.rollout.workers.health import PoolHealth
from rlspec.rollout.errors import RolloutBackendLost, RolloutWorkerError
from rlspec.rollout.workers.spot import DrafterHub
from rlspec.rollout.workers.stats import merge_stats
from rlspec.rollout.workers.tasks import split, merge
from rlspec.rollout.workers.worker import RolloutWorker

log = logging.getLogger(__name__)


class RayPool:
    def __init__(self, policy, tokenizer, spec: SpecConfig | None = None, *, workers: int | None = None,
                 ray_address: str | None = None, groups_per_task: int = 1, worker_threads: int | None = None,
                 drafter_trainer: str = "spot", drafter_trainer_gpus: float = 0.0,
                 drafter_trainer_kwargs: dict | None = None, max_task_retries: int = 2, ray_dashboard: bool = False,
                 cluster_lost_after_s: float = 15.0, task_deadline_multiple: float = 5.0,
                 task_deadline_floor_s: float = 30.0, task_deadline_first_s: float = 300.0, **engine_kwargs):
        """policy: an HF causal LM (gathered); the rest: RolloutSection's fields (rlspec/config/sections.py).
        max_task_retries: retries of one task (on other workers) before the call fails; ray_dashboard:
        start Ray's dashboard with a local cluster; cluster_lost_after_s: how long the Ray head may be
        unreachable before calls raise RolloutBackendLost (Ray itself ends the process at 60 s);
        task_deadline_*: how long one task may run before its worker counts as stuck (dropped, replaced, the
        task re-run): multiple x the slowest recent task, at least floor_s; first_s before any was measured."""
        if drafter_trainer not in ("spot", "dedicated"):
            raise ValueError(f"drafter_trainer must be 'spot' or 'dedicated', got {drafter_trainer!r}")
        if max_task_retries < 0:
            raise ValueError(f"rollout.max_task_retries must be >= 0, got {max_task_retries}")
        cluster.connect(ray_address, dashboard=ray_dashboard)
        n, gpus = _plan(workers)
        self.groups_per_task = groups_per_task
        self.max_task_retries = max_task_retries
        self.policy_version = 0
        self._dispatch = DispatchStats()
        self.deadline = TaskDeadline(task_deadline_multiple, task_deadline_floor_s, task_deadline_first_s)
        self._new_worker = None  # rank -> a new worker actor (set by _start), for replacing a dropped one
        self._weights_ref = None  # the newest policy weights in the object store (a replacement loads them)
        self._wall_s = 0.0
        self.workers: dict[int, object] = {}
        self.hub = None
        self._learned = False
        self._drafter: tuple[int, object] | None = None  # (version, ObjectRef of the weights)
        self._held: dict[int, int] = {}  # drafter version each worker holds
        self._final_drafter = None  # what export_drafter writes once close() has let the workers go
        self._close_error: BaseException | None = None  # why close() could not read the drafter
        self.watch = cluster.ClusterWatch(lost_after_s=cluster_lost_after_s)
        # drafter health (docs/gpu.md#what-the-metrics-should-look-like): pushes read back, speculation off while
        # the drafter does not pay
        enabled = (spec or SpecConfig()).enabled
        self.health = PoolHealth(HealthConfig(enforce=spec.selector != "always")) if enabled else None
        try:
            self._start(policy, tokenizer, spec, n, gpus, worker_threads, engine_kwargs, drafter_trainer,
                        drafter_trainer_gpus, drafter_trainer_kwargs or {})
        except BaseException:
            self._kill_all()  # the actors started so far would otherwise hold their CPUs/GPUs until Ray exits
            raise

    def _start(self, policy, tokenizer, spec, n, gpus, worker_threads, engine_kwargs, drafter_trainer,
               drafter_trainer_gpus, drafter_trainer_kwargs) -> None:
        """The workers (and the hub): each actor is in self.workers/self.hub as soon as it exists, so a
        failure part-way leaves _kill_all() a complete list."""
        spec = spec or SpecConfig()
        # the workers' engines never train a drafter themselves: the pool's one hub does (or nobody)
        worker_spec = replace(spec, online_training=False) if spec.enabled else spec
        blob = ray.put(_policy_blob(policy, tokenizer))
        actor = ray.remote(RolloutWorker).options(num_cpus=1, num_gpus=1 if gpus else 0, max_concurrency=1)
        threads = worker_threads if worker_threads is not None else (None if gpus else 1)
        self._new_worker = lambda r: actor.remote(r, blob, tokenizer, worker_spec, engine_kwargs, threads)
        for r in range(n):
            self.workers[r] = self._new_worker(r)
        # a worker that cannot build its engine raises here, with its own traceback
        self.infos = _started([w.info.remote() for w in self.workers.values()], "rollout workers")
        self._learned = self.infos[0]["learned"]
        self._held = {r: 0 for r in self.workers}
        if self._learned and spec.online_training is not False:
            self._start_hub(spec, drafter_trainer, drafter_trainer_gpus, drafter_trainer_kwargs)

    # ---- the RolloutBackend protocol ---------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams | None = None) -> list[RolloutResult]:
        """params.n samples of each prompt, prompt-major; see tasks.py for what params.seed promises."""
        params = params or SamplingParams()
        if not prompt_token_ids:
            raise ValueError("generate() needs at least one prompt")
        self.watch.check()
        tasks = split(prompt_token_ids, params, self.groups_per_task)
        t0 = time.perf_counter()
        idle = (lambda i: self.hub.set_idle.remote(i)) if self.hub is not None else (lambda i: None)
        if self.health is not None:
            self.health.before_rollout(self._call_all)
        done = self._run(tasks, idle)
        if self.health is not None:
            self.health.after_rollout(self._call_all)
        self._broadcast_drafter()  # between steps every worker holds the newest drafter
        self._wall_s += time.perf_counter() - t0
        results = merge(tasks, done)
        stale = [r.policy_version for r in results if r.policy_version != self.policy_version]
        if stale:
            raise RolloutWorkerError(f"{len(stale)} samples carry policy version {stale[0]}, not {self.policy_version}")
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One object-store copy of the policy for every worker; bumps policy_version (checked per task)."""
        self.watch.check()
        ref = ray.put({name: t.detach().cpu() for name, t in named_tensors})
        self.policy_version += 1
        self._weights_ref = ref
        held = self._call_all("load_weights", ref, self.policy_version)
        if any(v != self.policy_version for v in held.values()):
            raise RolloutWorkerError(f"workers hold policy versions {held}, expected {self.policy_version}")
        if self.health is not None:
            self.health.synced(self.policy_version)

    def stats(self) -> dict[str, float]:
        per_worker = self._call_all("stats")
        out = merge_stats(list(per_worker.values()), self._wall_s)
        d = self._dispatch
        counts = [d.tasks_per_worker.get(r, 0) for r in self.workers]
        out.update({"workers/alive": float(len(self.workers)), "workers/lost": float(len(d.lost_workers)),
                    "workers/stuck": float(len(d.stuck_workers)), "workers/replaced": float(d.replaced_workers),
                    "workers/retried_tasks": float(d.retried_tasks), "workers/idle_windows": float(d.idle_windows),
                    "workers/tail_s": d.tail_s,
                    "workers/tasks_max": float(max(counts, default=0)), "workers/tasks_min": float(min(counts, default=0)),
                    M.POLICY_VERSION: float(self.policy_version)})
        if self._learned:
            out["drafter/worker_version_min"] = min(v.get("drafter/version", 0.0) for v in per_worker.values())
        if self.hub is not None:
            out.update(self._hub_call("metrics", self.policy_version))
        if self.health is not None:
            out.update(self.health.metrics())
        self._dispatch, self._wall_s = DispatchStats(lost_workers=d.lost_workers, stuck_workers=d.stuck_workers), 0.0
        return out

    def release_kv(self) -> None:
        self._call_all("release_kv")

    @property
    def has_learned_drafter(self) -> bool:
        return self._learned

    def warm_start_drafter(self, prompts: list[list[int]], *, budget_s: float, group: int, max_new_tokens: int,
                           temperature: float):
        """Warm the drafter on one worker (or load the cache there), then make it every worker's and the hub's."""
        from rlspec.rollout.speculation.training.warm_start import WarmStartResult

        first = next(iter(self.workers.values()))
        result, state = self._get(first.warm_start.remote(prompts, budget_s=budget_s, group=group,
                                                          max_new_tokens=max_new_tokens, temperature=temperature))
        version = self._hub_call("load_weights", state) if self.hub is not None else 1 + max(self._held.values())
        self._publish(version, state)
        self._broadcast_drafter()
        return WarmStartResult(**result)

    def train_drafter(self, steps: int) -> float:
        """`steps` hub optimizer steps now, published and handed to every worker (between RL steps, tests)."""
        if self.hub is None:
            raise ValueError("this pool trains no drafter: use drafter eagle3/auto with online_training on")
        loss = self._hub_call("train_steps", steps)
        self._poll_drafter()
        self._broadcast_drafter()
        return loss

    def export_drafter(self, path: str, metadata: dict | None = None) -> str:
        """The run's one drafter (the hub's master weights, else the workers' shared one), written here."""
        from rlspec.rollout.speculation.drafters.eagle3_io import save_eagle3

        if not self._learned:
            raise ValueError("this pool has no learned drafter to export; use drafter='eagle3' or 'auto'")
        if self._final_drafter is None and not self.workers:
            raise RolloutWorkerError(f"the pool was closed without its drafter: reading it failed with "
                                     f"{self._close_error!r}; the last checkpoint's drafter is the newest saved")
        net, hf_config, version = self._final_drafter or self._fetch_drafter()
        meta = {"policy_version": self.policy_version, "drafter_version": version, **(metadata or {})}
        return save_eagle3(net, hf_config, path, metadata=meta)

    def close(self) -> None:
        """Stop the hub and the workers (their actors are killed); the drafter stays exportable.

        Never raises, so a close() in a finally block cannot hide the error that brought the run
        there: a drafter that cannot be read (hub or cluster gone) is logged, and export_drafter
        raises it. Every actor is killed whatever happened before. Safe to call twice."""
        try:
            if self._learned and self.workers and self._final_drafter is None:
                if self.hub is not None:
                    self._hub_call("stop")  # its last steps published before the weights are read
                self._final_drafter = self._fetch_drafter()
        except Exception as err:  # noqa: BLE001 - reported by export_drafter; see the docstring
            self._close_error = err
            log.error("closing the Ray pool: could not read the run's drafter (%s: %s); killing the actors anyway",
                      type(err).__name__, err)
        finally:
            self._kill_all()

    def _kill_all(self) -> None:
        # a kill goes through the head: with the head unreachable it cannot be confirmed, and waiting for it would
        # only spend the time Ray leaves the trainer for its checkpoint
        down = self.watch.down_since
        wait_s = 0.0 if down is not None and time.monotonic() - down >= self.watch.lost_after_s else 10.0
        kill_and_wait([a for a in (self.hub, *self.workers.values()) if a is not None], timeout_s=wait_s)
        self.hub, self.workers = None, {}
        self.watch.close()

    def _fetch_drafter(self):
        """(float32 network on this machine, the target's HF config, version) of the run's drafter."""
        first = next(iter(self.workers.values()))
        net, hf_config = self._get([first.drafter_network.remote(), first.hf_config.remote()])
        version = self._drafter[0] if self._drafter else 0
        if self.hub is not None:
            version, state = self._hub_call("weights")
            net.load_state_dict(state)
        return net, hf_config, version

    # ---- internals -------------------------------------------------------------------------------
    def _run(self, tasks, idle) -> dict[int, list]:
        def submit(rank, task):
            version, ref = self._drafter or (0, None)
            behind = ref is not None and self._held.get(rank, 0) < version
            if behind:
                self._held[rank] = version
            return self.workers[rank].run.remote(task, self.policy_version, version, ref if behind else None)

        return run_tasks(self.workers, tasks, submit, on_idle=idle, on_done=lambda r: self._poll_drafter(),
                         stats=self._dispatch, max_task_retries=self.max_task_retries, check=self.watch.check,
                         deadline=self.deadline, replace=self._replace_worker)

    def _replace_worker(self) -> int | None:
        """Start a worker in place of a dropped one, holding the current policy (and, with its first task, the
        drafter); None when it cannot start (the cluster lost the node's resources: the pool goes on smaller)."""
        if self._new_worker is None:
            return None
        rank = max([*self.workers, *self._dispatch.lost_workers, -1]) + 1
        worker = self._new_worker(rank)
        try:
            info = _started([worker.info.remote()], "a replacement rollout worker", timeout_s=self.deadline.first_s)[0]
            limit = self.deadline.first_s  # a replacement stuck too must not hang the call that replaces
            if info.get("learned") and self.hub is not None:
                ray.get(worker.attach_hub.remote(self.hub, self._hub_topk), timeout=limit)
            if self._weights_ref is not None:
                ray.get(worker.load_weights.remote(self._weights_ref, self.policy_version), timeout=limit)
        except Exception as err:  # noqa: BLE001 - the pool goes on with the workers it has
            log.warning("could not start a replacement rollout worker: %s", err)
            kill_and_wait([worker])
            return None
        self.workers[rank], self._held[rank] = worker, 0
        return rank

    def _get(self, refs):
        """ray.get that raises RolloutBackendLost instead of hanging when the Ray head is gone."""
        return cluster.get(refs, self.watch.check)

    def _hub_call(self, method: str, *args):
        """hub.method(*args), waited for; a dead hub is the run's drafter trainer gone: RolloutBackendLost."""
        try:
            return self._get(getattr(self.hub, method).remote(*args))
        except ray.exceptions.RayActorError as err:
            raise RolloutBackendLost(f"the drafter trainer (the DrafterHub actor, rollout.drafter_trainer) died; "
                                     f"Ray says:\n{err}") from err

    def _poll_drafter(self) -> None:
        """Take the hub's newest published drafter, if any (one put; workers get it with their next task)."""
        if self.hub is None:
            return
        got = self._hub_call("latest", self._drafter[0] if self._drafter else 0)
        if got is not None:
            self._publish(*got)

    def _publish(self, version: int, state: dict) -> None:
        """The drafter version every worker takes next (fingerprinted first: drafter health reads it back)."""
        self._drafter = (version, ray.put(state))
        if self.health is not None:
            self.health.published(version, state)

    def _broadcast_drafter(self) -> None:
        self._poll_drafter()
        if self._drafter is not None:
            self._held.update(self._call_all("set_drafter", *self._drafter))
            if self.health is not None:
                self.health.broadcast(self._call_all)

    def _call_all(self, method: str, *args) -> dict[int, object]:
        """method(*args) on every worker; a dead worker is dropped, a stuck one (past the task deadline) dropped and
        replaced (dispatch.call_all); the rest answer."""
        self.watch.check()
        return call_all(self.workers, method, args, stats=self._dispatch, deadline=self.deadline,
                        replace=self._replace_worker, check=self.watch.check)

    def _start_hub(self, spec: SpecConfig, mode: str, gpus: float, trainer_kwargs: dict) -> None:
        """The run's one drafter trainer, built from worker 0's drafter; every worker ships it samples."""
        first = next(iter(self.workers.values()))
        device = "cuda" if gpus > 0 else "cpu"
        recipe, state = ray.get(first.drafter_recipe.remote(trainer_kwargs, spec.trainer_threads or 1, device))
        opts = dict(num_cpus=0, num_gpus=0) if mode == "spot" else dict(num_cpus=1, num_gpus=gpus)
        free = ray.available_resources()
        if opts["num_cpus"] > free.get("CPU", 0) or opts["num_gpus"] > free.get("GPU", 0):
            raise ValueError(f"the dedicated drafter trainer needs {opts} but the Ray cluster has {free} left after "
                             "the workers; lower rollout.workers or use rollout.drafter_trainer=spot")
        self.hub = hub = ray.remote(DrafterHub).options(**opts).remote(recipe, state, mode)
        _started([hub.metrics.remote(0)], "the drafter trainer")
        if spec.drafter_path:  # a trained drafter keeps its draft vocabulary and head (never re-chosen)
            ray.get(hub.load_weights.remote(state))
        self._hub_topk = topk = trainer_kwargs.get("topk", 32) if trainer_kwargs.get("loss", "kl") != "ce" else 0
        ray.get([w.attach_hub.remote(hub, topk) for w in self.workers.values()])


def _started(refs: list, what: str, timeout_s: float = 600.0) -> list:
    """Wait for actors' first answers; a cluster without the resources they asked for never starts them."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RolloutWorkerError(f"{what} did not start within {timeout_s:.0f} s: the Ray cluster lacks the CPUs/GPUs "
                                 "they reserve (see `ray status`); lower rollout.workers or add nodes") from None


def _plan(workers: int | None) -> tuple[int, bool]:
    """(how many workers, whether they take a GPU each): one per GPU in the cluster, else one per CPU."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 1))
    n = workers or gpus or cpus
    have = gpus if gpus else cpus
    if n > have:
        raise ValueError(f"rollout.workers={n} but the Ray cluster has {have} {'GPUs' if gpus else 'CPUs'}; "
                         "lower rollout.workers or add nodes (ray start --address=...)")
    return n, gpus > 0


def _policy_blob(policy, tokenizer) -> dict:
    """What a worker needs to build its engine: config, the family the live policy was recognised as (a worker
    sees no model classes, runtime/model/families.py), weights (CPU) and the EOS ids generate would use."""
    return {"config": policy.config, "family": family_of_model(policy),
            "state": {k: v.detach().cpu() for k, v in policy.state_dict().items()},
            "eos": resolve_eos(policy, tokenizer)}
