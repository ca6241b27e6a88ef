"""Drafter health on the Ray pool (rollout/workers/health.py), real Ray and a real worker: faults injected into
a drafter push on its way to the worker (a dropped tensor, random weights) turn speculation off on the worker, a
verified push makes the next rollout a probe that turns it back on, and acceptance below the floor turns it off
again. One local Ray, one worker, one spot hub that publishes when asked (train_drafter)."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

import rlspec.rollout.workers.pool as pool_module  # noqa: E402
from rlspec.rollout.backend import build_backend  # noqa: E402
from rlspec.rollout.types import SamplingParams, SpecConfig  # noqa: E402
from tests.conftest import make_tiny_hf, random_prompts  # noqa: E402

SPEC = SpecConfig(drafter="eagle3", num_draft_tokens=2, selector="always", online_training=True, draft_vocab_size=64)
HUB = dict(min_tokens=32, publish_every=10**6, batch=2, window=16)
PROMPTS = random_prompts(4, 4, 10, seed=3)
PARAMS = SamplingParams(temperature=0.9, n=3, max_new_tokens=16, seed=1, ignore_eos=True)


@pytest.fixture(scope="module")
def pool():
    from rlspec.rollout.workers import cluster

    cluster.connect(num_cpus=2)
    p = build_backend("ray", make_tiny_hf("llama", seed=5), None, SPEC, workers=1, groups_per_task=2,
                      drafter_trainer="spot", drafter_trainer_kwargs=HUB, max_model_len=160, max_num_seqs=16,
                      dtype="float32")
    p.health.health.cfg.enforce = True  # "always" only warns by default: these tests check what it does
    p.health.health.cfg.floor = 0.0  # the untrained drafter accepts little: judged on faults first
    yield p
    p.close()
    ray.shutdown()


def push(pool, monkeypatch, corrupt=None) -> dict:
    """One hub step published and broadcast; `corrupt(state) -> state` alters what travels to the workers."""
    if corrupt is not None:
        real_put = ray.put
        monkeypatch.setattr(pool_module.ray, "put", lambda value: real_put(corrupt(value)))
    pool.train_drafter(1)
    monkeypatch.undo()
    return pool.stats()


def test_faulty_pushes_turn_speculation_off_and_a_verified_one_brings_it_back(pool, monkeypatch):
    import torch

    pool.generate(PROMPTS, PARAMS)  # samples for the hub to train on
    stats = push(pool, monkeypatch, lambda s: {k: v for k, v in s.items() if k != "fc.weight"})
    assert stats["drafter/health/bad_pushes"] == 1 and stats["drafter/health/speculating"] == 1.0  # until the next
    pool.generate(PROMPTS, PARAMS)
    stats = pool.stats()
    assert stats["drafter/health/ok"] == 0 and stats["drafter/health/speculating"] == 0
    assert stats["rollout/spec_step_share"] == 0  # the worker decoded plainly

    stats = push(pool, monkeypatch)  # intact: read back, verified; the next rollout probes
    assert stats["drafter/health/bad_pushes"] == 1
    pool.generate(PROMPTS, PARAMS)
    stats = pool.stats()
    assert stats["rollout/spec_step_share"] > 0 and stats["drafter/health/ok"] == 1
    assert stats["drafter/health/recovered"] == 1 and stats["drafter/health/probes"] == 1

    stats = push(pool, monkeypatch, lambda s: {k: torch.randn_like(v) if v.is_floating_point() else v
                                               for k, v in s.items()})
    assert stats["drafter/health/bad_pushes"] == 2 and stats["drafter/health/ok"] == 0


def test_acceptance_below_the_floor_turns_speculation_off(pool, monkeypatch):
    push(pool, monkeypatch)  # a verified push: the next rollout is a probe
    pool.health.health.cfg.floor = 0.0
    pool.generate(PROMPTS, PARAMS)
    stats = pool.stats()
    assert stats["drafter/health/ok"] == 1
    off = stats.get("drafter/health/turned_off", 0)  # by the test before, where it ran in this process
    pool.health.health.cfg.floor = 1.01  # no drafter reaches it
    pool.generate(PROMPTS, PARAMS)
    stats = pool.stats()
    assert stats["drafter/health/ok"] == 0 and stats["drafter/health/turned_off"] == off + 1
    pool.generate(PROMPTS, PARAMS)
    assert pool.stats()["rollout/spec_step_share"] == 0
