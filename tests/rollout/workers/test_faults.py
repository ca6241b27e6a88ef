"""Faults of the Ray pool with real Ray (rollout/workers/dispatch.py, cluster.py, pool.py): a local Ray
that listens on 127.0.0.1 only, bounded retries of a task that kills its workers, dropped workers
killed, and a lost Ray head raising RolloutBackendLost (in a child process: Ray ends a driver whose
head is gone, so the test's own process must not be that driver). The dispatch tests use tiny actors
that really die (os._exit) or really hold stale weights, not engines: the queue is what is tested."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from rlspec.rollout.types import SamplingParams  # noqa: E402
from rlspec.rollout.workers import cluster  # noqa: E402
from rlspec.rollout.workers.dispatch import DispatchStats, TaskDeadline, run_tasks  # noqa: E402
from rlspec.rollout.errors import RolloutBackendLost, RolloutWorkerError  # noqa: E402
from rlspec.rollout.workers.tasks import split  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def local_ray():
    cluster.connect(num_cpus=2)
    yield
    ray.shutdown()


class Toy:
    """A stand-in worker: `mode` says how its run() fails ("exit": the process dies, "stale": it raises
    the worker's StaleWeightsError and stays alive) or "ok"."""

    def __init__(self, mode: str):
        self.mode = mode

    def run(self, task):
        if self.mode == "sleep":
            import time

            time.sleep(600)  # alive, stuck
        if self.mode == "exit":
            os._exit(1)
        if self.mode == "stale":
            from rlspec.rollout.workers.worker import StaleWeightsError

            raise StaleWeightsError("holds policy version 0, the pool asked for 1")
        return [task.index]

    def ping(self) -> str:
        return "pong"

    def info(self) -> dict:
        return {"learned": False}

    def load_weights(self, weights, version: int) -> int:
        if self.mode == "sleep_in_sync":
            import time

            time.sleep(60)  # alive, stuck in the policy sync (long enough: a regression fails in a minute)
        return version


def toys(*modes):
    actor = ray.remote(Toy).options(num_cpus=0)
    return {r: actor.remote(m) for r, m in enumerate(modes)}


def tasks(n):
    return split([[1, 2]] * n, SamplingParams(seed=0), 1)


def test_a_local_ray_listens_on_loopback_only_without_a_dashboard(local_ray):
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    ours = psutil.Process().children(recursive=True) + [psutil.Process()]
    pids = {p.pid for p in ours}
    listening = [c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid in pids]
    assert listening, "found none of Ray's servers"
    assert all(ip.removeprefix("::ffff:") == "127.0.0.1" for ip in listening), listening
    # Ray keeps a minimal dashboard head for its usage stats; the web dashboard itself is off
    heads = [" ".join(p.cmdline()) for p in ours if "dashboard.py" in " ".join(p.cmdline())]
    assert all("--disable-frontend" in c for c in heads), heads
    assert not ray._private.worker.global_worker.node.address_info.get("webui_url")


def test_a_task_that_kills_every_worker_stops_after_max_task_retries(local_ray):
    workers = toys("exit", "exit", "ok")
    stats = DispatchStats()
    with pytest.raises(RolloutWorkerError, match=r"failed 2 times \(on workers \[0, 1\]\); rollout.max_task_retries=1"):
        run_tasks(workers, tasks(1), lambda r, t: workers[r].run.remote(t), stats=stats, max_task_retries=1)
    assert stats.lost_workers == [0, 1] and stats.retried_tasks == 1
    assert ray.get(workers[2].ping.remote()) == "pong"  # the rest of the pool survives the poisonous task
    # the same task with one more retry allowed lands on the healthy worker
    workers = toys("exit", "ok")
    done = run_tasks(workers, tasks(1), lambda r, t: workers[r].run.remote(t), max_task_retries=1)
    assert done == {0: [0]}


def test_a_dropped_worker_is_killed_and_no_worker_left_is_backend_lost(local_ray):
    workers = toys("stale", "ok")
    stale = workers[0]
    done = run_tasks(workers, tasks(3), lambda r, t: workers[r].run.remote(t))
    assert done == {0: [0], 1: [1], 2: [2]} and list(workers) == [1]
    with pytest.raises(ray.exceptions.RayActorError):  # alive but out of step: killed, not left running
        ray.get(stale.ping.remote(), timeout=30)
    workers = toys("exit")
    with pytest.raises(RolloutBackendLost, match="no rollout worker is left(.|\n)*resume=auto"):
        run_tasks(workers, tasks(2), lambda r, t: workers[r].run.remote(t))


def test_a_stuck_worker_is_dropped_at_its_deadline_replaced_and_its_task_rerun(local_ray):
    """Worker 0 sleeps in its task (alive, stuck): at the deadline (a multiple of the measured task time, at
    least the floor) it is killed, a new worker takes its place, and its task (the same Task: the same sample
    keys) is run again; the call ends in seconds, not when the sleep would."""
    import time

    workers = toys("sleep", "ok")
    stuck = workers[0]
    ray.get([w.ping.remote() for w in workers.values()])  # started: the deadline times tasks, not actor starts
    deadline = TaskDeadline(multiple=3.0, floor_s=3.0, first_s=3.0)
    stats, made = DispatchStats(), []

    def replace():
        rank = 10 + len(made)
        workers[rank] = ray.remote(Toy).options(num_cpus=0).remote("ok")
        ray.get(workers[rank].ping.remote())  # as the pool does: a replacement joins once it runs
        made.append(rank)
        return rank

    t0 = time.monotonic()
    done = run_tasks(workers, tasks(4), lambda r, t: workers[r].run.remote(t), stats=stats, deadline=deadline,
                     replace=replace, poll_s=0.2)
    assert time.monotonic() - t0 < 30
    assert done == {i: [i] for i in range(4)}  # every task's own result, task 0's from its re-run
    assert stats.stuck_workers == [0] and stats.lost_workers == [0] and stats.replaced_workers == 1
    assert sorted(workers) == [1, 10] and "past its deadline of 3 s" in stats.errors[0]
    with pytest.raises(ray.exceptions.RayActorError):  # killed, not left holding its CPU
        ray.get(stuck.ping.remote(), timeout=30)
    assert deadline.limit_s() == max(3.0, 3.0 * max(deadline.recent)) and len(deadline.recent) == 4


def test_a_worker_stuck_in_a_weight_sync_is_dropped_at_the_deadline_and_replaced(local_ray):
    """The calls the pool makes on every worker (load_weights, set_drafter, stats: RayPool._call_all) have the
    tasks' deadline: worker 0 sleeps in load_weights; at the deadline it is killed, a new worker takes its place
    and answers, and the call ends in seconds. The pool's own path around stand-in workers instead of engines
    (the weights are a plain object here: a worker that unpickles tensors imports torch first, seconds of CPU)."""
    import time

    from rlspec.rollout.workers.pool import RayPool

    actor = ray.remote(Toy).options(num_cpus=0)
    pool = RayPool.__new__(RayPool)
    pool.workers = {0: actor.remote("sleep_in_sync"), 1: actor.remote("ok")}
    stuck = pool.workers[0]
    ray.get([w.ping.remote() for w in pool.workers.values()])
    pool._new_worker = lambda rank: actor.remote("ok")
    # the rollout tasks took 0.1 s: the limit is the 3 s floor (first_s bounds the replacement's start)
    pool._dispatch, pool.deadline = DispatchStats(), TaskDeadline(multiple=3.0, floor_s=3.0, first_s=60.0)
    pool.deadline.measured(0.1)
    pool.policy_version, pool._weights_ref, pool._held, pool.hub = 1, None, {0: 0, 1: 0}, None
    pool.watch = cluster.ClusterWatch()
    try:
        t0 = time.monotonic()
        held = pool._call_all("load_weights", "the weights", 1)
        assert time.monotonic() - t0 < 30  # not the 60 s of the sleep
    finally:
        pool.watch.close()
    assert held == {1: 1, 2: 1} and sorted(pool.workers) == [1, 2]
    d = pool._dispatch
    assert d.stuck_workers == [0] and d.lost_workers == [0] and d.replaced_workers == 1
    assert "did not answer load_weights" in d.errors[0] and "past its deadline of 3 s" in d.errors[0]
    with pytest.raises(ray.exceptions.RayActorError):  # killed, not left holding its CPU
        ray.get(stuck.ping.remote(), timeout=30)


def test_the_deadline_is_a_multiple_of_the_slowest_recent_task_with_a_floor():
    d = TaskDeadline(multiple=4.0, floor_s=10.0, first_s=300.0, window=2)
    assert d.limit_s() == 300.0  # nothing measured yet: the first rollout compiles and warms up
    d.measured(1.0)
    assert d.limit_s() == 10.0
    d.measured(5.0)
    d.measured(3.0)
    assert d.limit_s() == 20.0
    d.measured(1.0)  # the 5 s task left the window
    assert d.limit_s() == 12.0
    with pytest.raises(ValueError):
        TaskDeadline(multiple=0.5)


CHILD = textwrap.dedent("""
    import os, sys, time, psutil, ray
    from rlspec.rollout.backend import build_backend
    from rlspec.rollout.types import SamplingParams
    from rlspec.rollout.workers import cluster
    from rlspec.rollout.errors import RolloutBackendLost
    from tests.conftest import make_tiny_hf

    cluster.connect(num_cpus=1)
    pool = build_backend("ray", make_tiny_hf("llama", seed=1), None, None, workers=1, cluster_lost_after_s=1.0,
                         max_model_len=64, max_num_seqs=4, dtype="float32")
    pool.watch.interval_s = 0.3
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=0)
    assert len(pool.generate([[1, 2, 3]], params)) == 1
    for p in psutil.Process().children(recursive=True):
        if p.name() == "gcs_server":
            p.kill()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 20:  # actor calls go on without the head: the watch must catch it
            pool.generate([[1, 2, 3]], params)
    except RolloutBackendLost as err:
        print("LOST after", round(time.monotonic() - t0, 1), "s:", err, flush=True)
        t1 = time.monotonic()
        pool.close()  # never raises, even now
        print("CLOSED in", round(time.monotonic() - t1, 1), "s", flush=True)
        os._exit(0)
    os._exit(3)
""")


def test_a_lost_ray_head_raises_backend_lost_before_ray_ends_the_process():
    env = dict(os.environ, RAY_gcs_rpc_server_reconnect_timeout_s="40", PYTHONPATH=str(ROOT),
               RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert "LOST after" in out and "GCS at 127.0.0.1" in out and "resume=auto" in out and "CLOSED" in out, out
    # nor does it wait for kills that only the lost head could confirm: that time is the trainer's checkpoint's
    assert float(out.split("CLOSED in ")[1].split()[0]) < 5.0, out
    assert "does not answer" in proc.stderr  # the ERROR logged at the first failed probe
