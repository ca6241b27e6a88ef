"""The Ray pool (rollout/workers/) with real Ray on this machine: one local Ray (num_cpus=2) and one
two-worker pool for the module, tiny random models, float32 so results compare exactly."""
from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray")

from rollout.backend import RolloutBackend, build_backend  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.types import SamplingParams, SpecConfig  # noqa: E402
from rollout.workers.tasks import generate_in_tasks  # noqa: E402
from tests.conftest import make_tiny_hf, random_prompts  # noqa: E402

ENGINE = dict(max_model_len=160, max_num_seqs=16, dtype="float32")
PROMPTS = random_prompts(6, 4, 12, seed=2)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf("llama", seed=5)


@pytest.fixture(scope="module")
def pool(local_ray, hf):
    p = build_backend("ray", hf, None, None, workers=2, groups_per_task=2, **ENGINE)
    yield p
    p.close()


def params(seed=3, n=3, tokens=12):
    return SamplingParams(temperature=0.9, top_p=0.95, n=n, max_new_tokens=tokens, seed=seed, ignore_eos=True)


def same(a, b) -> bool:
    return [(r.prompt_index, r.sample_index, r.completion_ids, r.logprobs) for r in a] == \
        [(r.prompt_index, r.sample_index, r.completion_ids, r.logprobs) for r in b]


def test_two_workers_return_what_one_engine_returns_task_by_task(pool, hf):
    import torch

    assert isinstance(pool, RolloutBackend)
    got = pool.generate(PROMPTS, params())
    assert [(r.prompt_index, r.sample_index) for r in got] == [(i, j) for i in range(6) for j in range(3)]
    torch.set_num_threads(1)  # as each worker runs
    engine = RolloutEngine.from_hf_model(hf, None, **ENGINE)
    assert same(got, generate_in_tasks(engine, PROMPTS, params(), groups_per_task=2))
    # one task holding every prompt keeps the call's seed: exactly the plain engine's rollouts
    assert same(generate_in_tasks(engine, PROMPTS, params(), 6), engine.generate(PROMPTS, params()))
    assert not same(got, pool.generate(PROMPTS, params(seed=4)))  # the seed matters
    stats = pool.stats()
    assert stats["workers/tasks_min"] >= 1  # both workers took tasks (3 tasks, 2 workers)
    assert stats["rollout/num_sequences"] == 36 and stats["rollout/generated_tokens"] == 36 * 12


def test_bad_input_raises_the_engine_s_own_error_from_the_worker(pool):
    from rollout.errors import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="max_model_len"):
        pool.generate([list(range(3, 200))], params())
    assert pool.stats()["workers/alive"] == 2  # nobody was dropped for it


def test_weights_reach_every_worker_and_results_carry_the_version(pool, hf):
    import torch

    other = make_tiny_hf("llama", seed=6)
    before = pool.generate(PROMPTS[:2], params())
    pool.load_weights(other.state_dict().items())
    assert pool.policy_version == 1
    held = pool._call_all("stats")
    assert {r: s["rollout/policy_version"] for r, s in held.items()} == {0: 1.0, 1: 1.0}
    after = pool.generate(PROMPTS, params())
    assert {r.policy_version for r in after} == {1}
    torch.set_num_threads(1)
    ref = generate_in_tasks(RolloutEngine.from_hf_model(other, None, **ENGINE), PROMPTS, params(), 2)
    assert same(after, ref) and not same(after[:6], before)  # every worker samples the new policy
    pool.load_weights(hf.state_dict().items())  # back, for the tests after this one


def test_a_killed_worker_s_tasks_are_retried_on_the_survivor(pool, hf):
    """Last in the module: it kills one of the pool's two workers mid-call."""
    import torch

    long, prompts = params(tokens=140), random_prompts(24, 4, 12, seed=3)
    out: dict = {}
    call = threading.Thread(target=lambda: out.setdefault("r", pool.generate(prompts, long)))
    call.start()
    victim = pool.workers[1]
    for _ in range(2000):  # worker 1 finished a task and took the next of 12: kill it inside that one
        if pool._dispatch.tasks_per_worker.get(1, 0) >= 1:
            break
        time.sleep(0.005)
    ray.kill(victim, no_restart=True)
    call.join(timeout=120)
    stats = pool.stats()
    assert stats["workers/lost"] == 1 and stats["workers/retried_tasks"] >= 1 and stats["workers/alive"] == 1
    torch.set_num_threads(1)
    engine = RolloutEngine.from_hf_model(hf, None, **ENGINE)
    assert same(out["r"], generate_in_tasks(engine, prompts, long, 2))  # the retry changed nothing


def test_the_drafter_version_advances_on_every_worker(local_ray, hf, pool, tmp_path):
    pool.close()  # the CPUs go to a pool with a learned drafter
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=2, selector="always", online_training=True,
                      draft_vocab_size=64)
    p = build_backend("ray", hf, None, spec, workers=2, groups_per_task=1, drafter_trainer="spot",
                      drafter_trainer_kwargs=dict(min_tokens=32, publish_every=1, batch=2, window=16), **ENGINE)
    try:
        p.generate(PROMPTS, params(tokens=16))  # features of every worker flow to the hub
        for _ in range(100):  # the last tasks' samples may still be in flight (fire-and-forget)
            if ray.get(p.hub.metrics.remote(0))["drafter/samples_received"] == 18:
                break
            time.sleep(0.1)
        spot = ray.get(p.hub.metrics.remote(0))
        assert spot["drafter/spot_idle_s"] > 0  # the 6th task ran alone: the hub was told a worker was idle
        loss = p.train_drafter(2)
        assert loss == loss  # a real loss: the hub had data
        stats = p.stats()
        assert stats["drafter/samples_received"] == 18 and stats["drafter/shipped_samples"] == 18
        assert stats["drafter/version"] >= 1
        assert stats["drafter/worker_version_min"] == stats["drafter/version"]  # every worker took it
        p.generate(PROMPTS, params(tokens=16))  # and drafts with it
        assert p.stats()["rollout/spec_step_share"] > 0.5
    finally:
        p.close()
    # one drafter for the run, exported once, also after close() let the workers go
    p.export_drafter(str(tmp_path / "drafter"))
    assert (tmp_path / "drafter" / "config.json").is_file()
