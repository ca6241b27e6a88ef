"""GroupPool (trainers/partial_rollouts.py) on a real tiny engine, without TRL: which groups a run trains, the
drain at its end, the staleness bound and restarts, the pool's state across a checkpoint."""
from __future__ import annotations

import pytest

from rollout.engine import RolloutEngine
from rollout.runtime.model import loader
from rollout.types import SamplingParams
from tests.conftest import make_tiny_hf
from trainers.partial_rollouts import GroupPool, PartialRolloutConfig

CAP = 24


def engine_and_generate(seed: int = 0):
    engine = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama", vocab=8)), None, eos_token_ids=[2],
                           max_num_seqs=16, kv_memory_gb=0.01)
    calls = iter(range(10**6))

    def generate(prompts, plan):
        return engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=CAP, seed=seed * 1000 +
                                                       next(calls)), partial=plan)
    return engine, generate


def run(pool: GroupPool, generate, steps: int, fill=lambda i: [1, 3 + i % 5]):
    """`steps` rounds, one optimizer step each, new prompts as TRL would give them; the trained groups' orders."""
    trained, drawn = [], iter(range(10**6))

    def group() -> list[dict]:
        return [{"i": next(drawn)}] * pool.group_size

    for step in range(steps):  # TRL's batch of the step, then extra prompts
        pool.fill([group() for _ in range(pool.train_groups)], group, lambda row: fill(row["i"]), steps - step)
        trained += [g.order for g in pool.round(generate, step)]
    return trained, pool.entered


def test_a_draining_run_trains_every_group_it_started_each_whole():
    _, generate = engine_and_generate()
    pool = GroupPool(PartialRolloutConfig(oversample=1.0, max_staleness=3), group_size=3, train_groups=2,
                     steps_per_round=1, max_new_tokens=CAP)
    trained, entered = run(pool, generate, steps=6)
    assert sorted(trained) == list(range(entered)) and not pool.groups  # nothing left in flight, none twice
    assert pool.skipped == 2  # TRL's last batch: the rounds left train what the pool held
    assert pool.dropped == 0


def test_without_the_drain_the_longest_groups_are_left_in_flight():
    """What the drain prevents: with rounds_left unknown the pool ends holding oversample x train_groups groups."""
    _, generate = engine_and_generate()
    pool = GroupPool(PartialRolloutConfig(oversample=1.0, max_staleness=3), 3, 2, 1, CAP)
    trained = []
    for step in range(6):
        while pool.wants():
            pool.add([{}] * 3, [1, 3 + pool.entered % 5])
        trained += pool.round(generate, step)
    assert len(pool.groups) == 2 and len(trained) == 12


def test_every_trained_token_is_within_max_staleness_and_a_starved_sample_restarts():
    _, generate = engine_and_generate(seed=1)
    pool = GroupPool(PartialRolloutConfig(oversample=2.0, max_staleness=2), 3, 2, 1, CAP)
    assert pool.min_decode_steps == CAP // 3  # a sample decoding every round ends within 3 rounds
    for step in range(5):
        while pool.wants(5 - step):
            pool.add([{}] * 3, [1, 3 + pool.entered % 5])
        for group in pool.round(generate, step):
            assert all(step - t <= 2 for s in group.samples for t in s.steps)
    # a sample that could not decode (no row free) for rounds: restarted before a round would train it too stale
    pool.add([{}] * 3, [1, 4])
    pool.groups[-1].samples[0].completion_ids, pool.groups[-1].samples[0].steps = [5], [0]
    pool.groups[-1].samples[0].logprobs = pool.groups[-1].samples[0].behaviour = [-1.0]
    pool._restart_stale(step=3)
    assert pool.dropped == 1 and not pool.groups[-1].samples[0].completion_ids


def test_the_pool_round_trips_through_its_state_dict():
    _, generate = engine_and_generate()
    pool = GroupPool(PartialRolloutConfig(), 3, 2, 1, CAP)
    for step in range(2):
        while pool.wants(10):
            pool.add([{"q": "x"}] * 3, [1, 3 + pool.entered % 5])
        pool.round(generate, step)
    assert any(s.completion_ids and not s.done for g in pool.groups for s in g.samples)
    copy = GroupPool(PartialRolloutConfig(), 3, 2, 1, CAP)
    copy.load_state_dict(pool.state_dict())
    assert copy.state_dict() == pool.state_dict()


def test_max_staleness_below_the_steps_between_rounds_is_refused():
    with pytest.raises(ValueError, match="below the 3 optimizer steps"):
        GroupPool(PartialRolloutConfig(max_staleness=2), 3, 2, steps_per_round=3, max_new_tokens=CAP)
