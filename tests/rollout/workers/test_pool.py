"""The Ray pool (rollout/workers/) with real Ray on this machine: one local Ray (num_cpus=2) and one
two-worker pool for the module (actor start-up is most of the cost), tiny random models, float32 so
results compare exactly. The pool speculates with the learned drafter at every step (selector
"always") and feeds a spot hub that publishes only when asked (train_drafter), so until then every
worker holds the same cold drafter as a fresh in-process engine and the rollouts must match it."""
from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray")

from rlspec.rollout.backend import RolloutBackend, build_backend  # noqa: E402
from rlspec.rollout.engine import RolloutEngine  # noqa: E402
from rlspec.rollout.types import SamplingParams, SpecConfig  # noqa: E402
from rlspec.rollout.workers.tasks import generate_in_tasks  # noqa: E402
from tests.conftest import make_tiny_hf, random_prompts  # noqa: E402

ENGINE = dict(max_model_len=160, max_num_seqs=16, dtype="float32")
PROMPTS = random_prompts(6, 4, 12, seed=2)


@pytest.fixture(scope="module")
def local_ray():
    from rlspec.rollout.workers import cluster

    cluster.connect(num_cpus=2)  # 127.0.0.1 only, no dashboard
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf("llama", seed=5)


SPEC = SpecConfig(drafter="eagle3", num_draft_tokens=2, selector="always", online_training=True, draft_vocab_size=64)
HUB = dict(min_tokens=32, publish_every=10**6, batch=2, window=16)  # trains in idle tails, publishes when asked


@pytest.fixture(scope="module")
def pool(local_ray, hf):
    p = build_backend("ray", hf, None, SPEC, workers=2, groups_per_task=2, drafter_trainer="spot",
                      drafter_trainer_kwargs=HUB, **ENGINE)
    yield p
    p.close()


def reference(hf):
    """One in-process engine with the same cold drafter, not trained (what the workers hold)."""
    import torch

    torch.set_num_threads(1)  # as each worker runs
    from dataclasses import replace

    return RolloutEngine.from_hf_model(hf, None, spec=replace(SPEC, online_training=False), **ENGINE)


def params(seed=3, n=3, tokens=12):
    return SamplingParams(temperature=0.9, top_p=0.95, n=n, max_new_tokens=tokens, seed=seed, ignore_eos=True)


def same(a, b) -> bool:
    return [(r.prompt_index, r.sample_index, r.completion_ids, r.logprobs) for r in a] == \
        [(r.prompt_index, r.sample_index, r.completion_ids, r.logprobs) for r in b]


def test_two_workers_return_what_one_engine_returns_task_by_task(pool, hf):
    assert isinstance(pool, RolloutBackend)
    got = pool.generate(PROMPTS, params())
    assert [(r.prompt_index, r.sample_index) for r in got] == [(i, j) for i in range(6) for j in range(3)]
    engine = reference(hf)
    assert same(got, generate_in_tasks(engine, PROMPTS, params(), groups_per_task=2))
    # one task holding every prompt keeps the call's seed: exactly the plain engine's rollouts
    assert same(generate_in_tasks(engine, PROMPTS, params(), 6), engine.generate(PROMPTS, params()))
    assert not same(got, pool.generate(PROMPTS, params(seed=4)))  # the seed matters
    stats = pool.stats()
    assert stats["workers/tasks_min"] >= 1  # both workers took tasks (3 tasks, 2 workers)
    assert stats["rollout/num_sequences"] == 36 and stats["rollout/generated_tokens"] == 36 * 12
    assert stats["rollout/spec_step_share"] > 0.8  # the drafter proposed at (nearly) every step


def test_bad_input_raises_the_engine_s_own_error_from_the_worker(pool):
    from rlspec.rollout.errors import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="max_model_len"):
        pool.generate([list(range(3, 200))], params())
    assert pool.stats()["workers/alive"] == 2  # nobody was dropped for it


def test_weights_reach_every_worker_and_results_carry_the_version(pool, hf):
    other = make_tiny_hf("llama", seed=6)
    before = pool.generate(PROMPTS[:2], params())
    pool.load_weights(other.state_dict().items())
    assert pool.policy_version == 1
    held = pool._call_all("stats")
    assert {r: s["rollout/policy_version"] for r, s in held.items()} == {0: 1.0, 1: 1.0}
    after = pool.generate(PROMPTS, params())
    assert {r.policy_version for r in after} == {1}
    ref = generate_in_tasks(reference(other), PROMPTS, params(), 2)
    assert same(after, ref) and not same(after[:6], before)  # every worker samples the new policy
    pool.load_weights(hf.state_dict().items())  # back, for the tests after this one


def test_the_drafter_version_advances_on_every_worker(pool, tmp_path):
    pool.generate(PROMPTS, params(tokens=16))  # features of every worker flow to the hub
    for _ in range(100):  # the last tasks' samples may still be in flight (fire-and-forget)
        if ray.get(pool.hub.metrics.remote(0))["drafter/samples_received"] >= 18:
            break
        time.sleep(0.1)
    spot = ray.get(pool.hub.metrics.remote(0))
    assert spot["drafter/spot_idle_s"] > 0  # a last task ran alone: the hub was told a worker was idle
    loss = pool.train_drafter(2)
    assert loss == loss  # a real loss: the hub had data
    stats = pool.stats()
    assert stats["drafter/samples_received"] == stats["drafter/shipped_samples"] >= 18
    assert stats["drafter/version"] >= 1
    assert stats["drafter/worker_version_min"] == stats["drafter/version"]  # every worker took it
    pool.export_drafter(str(tmp_path / "drafter"))  # one drafter for the run, written once
    assert (tmp_path / "drafter" / "config.json").is_file()


def test_a_killed_worker_s_tasks_are_retried_on_the_survivor(pool, hf):
    """Last in the module: it kills one of the pool's two workers mid-call (the drafter stays as the
    previous test left it; the reference takes the workers' weights). A replacement joins and the samples are
    the ones an undisturbed call gives."""
    long, prompts = params(n=2, tokens=100), random_prompts(12, 4, 12, seed=3)
    out: dict = {}
    call = threading.Thread(target=lambda: out.setdefault("r", pool.generate(prompts, long)))
    call.start()
    victim = pool.workers[1]
    for _ in range(2000):  # worker 1 finished a task and took the next of 6: kill it inside that one
        if pool._dispatch.tasks_per_worker.get(1, 0) >= 1:
            break
        time.sleep(0.005)
    ray.kill(victim, no_restart=True)
    call.join(timeout=120)
    stats = pool.stats()
    assert stats["workers/lost"] == 1 and stats["workers/retried_tasks"] >= 1
    # the dead worker was replaced (holding the current policy and drafter), so the pool keeps its size
    assert stats["workers/replaced"] == 1 and stats["workers/alive"] == 2
    engine = reference(hf)
    if pool._drafter is not None:  # the drafter the previous test trained: the workers' weights
        engine.speculation.learned.model.load_state_dict(ray.get(pool._drafter[1]))
    assert same(out["r"], generate_in_tasks(engine, prompts, long, 2))  # the retry changed nothing




def test_a_dead_drafter_trainer_is_backend_lost_and_close_still_kills_every_actor(pool):
    """After the killed-worker test: the hub dies; the next call says so (a trainer checkpoints on it),
    close() does not raise over it and kills the workers, and export_drafter reports what close() hit."""
    from rlspec.rollout.errors import RolloutBackendLost, RolloutWorkerError

    ray.kill(pool.hub, no_restart=True)
    with pytest.raises(RolloutBackendLost, match="drafter trainer(.|\n)*died(.|\n)*resume=auto"):
        pool.generate(PROMPTS[:2], params())
    workers = list(pool.workers.values())
    pool.close()  # never raises, even with the hub gone
    for w in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.info.remote(), timeout=30)
    with pytest.raises(RolloutWorkerError, match="closed without its drafter(.|\n)*RolloutBackendLost"):
        pool.export_drafter("unused")
