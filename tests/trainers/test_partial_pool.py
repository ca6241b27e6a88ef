"""GroupPool (trainers/partial_rollouts.py) on a real tiny engine, without TRL: which groups a run trains (TRL's,
drawn ahead, each once), groups TRL gives unforeseen, the drain at its end, the staleness bound and restarts, the
pool's state across a checkpoint."""
from __future__ import annotations

import pytest

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf
from rlspec.trainers.partial_rollouts import UNFORESEEN, GroupPool, PartialRolloutConfig

CAP = 24


def engine_and_generate(seed: int = 0, rows: int = 16):
    engine = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama", vocab=8)), None, eos_token_ids=[2],
                           max_num_seqs=rows, kv_memory_gb=0.01)
    calls = iter(range(10**6))

    def generate(prompts, plan, names):
        return engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=CAP, seed=seed * 1000 +
                                                       next(calls)), partial=plan)
    return engine, generate


def group(i: int, size: int) -> list[dict]:
    """Prompt i's rows, as TRL's dataloader gives them (one dict per sample)."""
    return [{"prompt": f"q{i}", "i": i} for _ in range(size)]


def prompt_ids(row: dict) -> list[int]:
    return [1, 3 + row["i"] % 5]


def run(pool: GroupPool, generate, steps: int, handed_out=lambda k: k):
    """`steps` rounds, one optimizer step each, the pool drawing ahead from the sequence 0, 1, 2, ... while TRL's
    batch k holds the groups handed_out(j) for j in batch k; the trained groups (their rows' i, ordinal)."""
    trained, sequence, b = [], iter(range(10**6)), pool.train_groups
    for step in range(steps):
        batch = [group(handed_out(j), pool.group_size) for j in range(step * b, (step + 1) * b)]
        pool.fill(batch, lambda: group(next(sequence), pool.group_size), prompt_ids, steps - step)
        trained += [(g.rows[0]["i"], g.ordinal) for g in pool.round(generate, step)]
    return trained


def test_a_run_trains_exactly_the_groups_trl_hands_out_each_whole_and_once():
    """TRL's batches arrive after the pool drew their groups ahead: checked off, never added twice; with the drain
    the run trains exactly TRL's 12 groups, skips none and leaves none in flight."""
    _, generate = engine_and_generate()
    pool = GroupPool(PartialRolloutConfig(oversample=1.0, max_staleness=3), group_size=3, train_groups=2,
                     steps_per_round=1, max_new_tokens=CAP)
    trained = run(pool, generate, steps=6)
    assert sorted(i for i, _ in trained) == list(range(12))  # TRL's groups, each once
    assert sorted(o for _, o in trained) == list(range(12))  # ordinal: the index in TRL's sequence
    assert all(i == o for i, o in trained)
    assert pool.entered == 12 and pool.skipped == 0 and pool.mismatched == 0
    assert not pool.groups and not pool.ahead and pool.dropped == 0
    assert [i for i, _ in trained] != list(range(12)), "the test did not exercise out-of-order finishing"


def test_groups_trl_hands_out_unforeseen_are_added_and_counted():
    """The replica foresaw group 3 but TRL gave group 100 there: 100 trains as a new group with an ordinal of its
    own, 3 (drawn ahead) trains too, and the sequence resynchronises at once."""
    _, generate = engine_and_generate()
    pool = GroupPool(PartialRolloutConfig(oversample=1.0, max_staleness=3), 3, 2, 1, CAP)
    trained = run(pool, generate, steps=6, handed_out=lambda k: 100 if k == 3 else k)
    assert pool.mismatched == 1 and pool.metrics([], 6)["partial/replica_mismatch"] == 1.0
    assert (100, UNFORESEEN) in trained and sum(i == 3 for i, _ in trained) == 1
    assert sorted(o for _, o in trained if o < UNFORESEEN) == list(range(len(trained) - 1))
    assert len(trained) == 12 and not pool.groups


def test_a_replica_that_never_matches_counts_every_group_and_stays_bounded():
    """A sampler the replica does not reproduce at all: every group of TRL's is counted, the queue of groups drawn
    ahead never outgrows the pool, and the drain still trains every group that entered."""
    _, generate = engine_and_generate()
    pool = GroupPool(PartialRolloutConfig(oversample=1.0, max_staleness=3), 3, 2, 1, CAP)
    trained = run(pool, generate, steps=8, handed_out=lambda k: 1000 + k)
    assert pool.mismatched == 16 and len(trained) == 16 and not pool.groups
    assert any(o >= UNFORESEEN for _, o in trained) and len({o for _, o in trained}) == 16
    assert len(pool.ahead) <= pool.capacity


def test_without_the_drain_the_longest_groups_are_left_in_flight():
    """What the drain prevents: with rounds_left unknown the pool ends holding oversample x train_groups groups."""
    _, generate = engine_and_generate()
    pool = GroupPool(PartialRolloutConfig(oversample=1.0, max_staleness=3), 3, 2, 1, CAP)
    trained = []
    for step in range(6):
        while pool.wants():
            pool.add([{}] * 3, [1, 3 + pool.entered % 5], pool.entered)
        trained += pool.round(generate, step)
    assert len(pool.groups) == 2 and len(trained) == 12


def test_every_trained_token_is_within_max_staleness_and_a_starved_sample_restarts():
    _, generate = engine_and_generate(seed=1)
    pool = GroupPool(PartialRolloutConfig(oversample=2.0, max_staleness=2), 3, 2, 1, CAP)
    assert pool.min_decode_steps == CAP // 3  # a sample decoding every round ends within 3 rounds
    for step in range(5):
        while pool.wants(5 - step):
            pool.add([{}] * 3, [1, 3 + pool.entered % 5], pool.entered)
        for group in pool.round(generate, step):
            assert all(step - t <= 2 for s in group.samples for t in s.steps)
    # a sample that could not decode (no row free) for rounds: restarted before a round would train it too stale
    pool.add([{}] * 3, [1, 4], 99)
    pool.groups[-1].samples[0].completion_ids, pool.groups[-1].samples[0].steps = [5], [0]
    pool.groups[-1].samples[0].logprobs = pool.groups[-1].samples[0].behaviour = [-1.0]
    pool._restart_stale(step=3)
    assert pool.dropped == 1 and not pool.groups[-1].samples[0].completion_ids


def test_the_pool_round_trips_through_its_state_dict():
    _, generate = engine_and_generate()
    pool = GroupPool(PartialRolloutConfig(), 3, 2, 1, CAP)
    run(pool, generate, steps=2)  # rounds_left 2, 1: drained at the end; go on undrained
    sequence = iter(range(4, 10**6))  # TRL's sequence goes on past the 4 groups the two rounds trained
    pool.fill([group(4, 3), group(5, 3)], lambda: group(next(sequence), 3), prompt_ids)
    pool.round(generate, 2)
    assert any(s.completion_ids and not s.done for g in pool.groups for s in g.samples) and pool.ahead
    copy = GroupPool(PartialRolloutConfig(), 3, 2, 1, CAP)
    copy.load_state_dict(pool.state_dict())
    assert copy.state_dict() == pool.state_dict()


def test_max_staleness_below_the_steps_between_rounds_is_refused():
    with pytest.raises(ValueError, match="below the 3 optimizer steps"):
        GroupPool(PartialRolloutConfig(max_staleness=2), 3, 2, steps_per_round=3, max_new_tokens=CAP)


def decode_guarantee_run(oversample: float, rounds: int = 12, plant=None):
    """`rounds` rounds at max_staleness 4 on an engine with rows and KV blocks for the whole pool: (pool, the
    fewest tokens a sample in flight gained in a round without finishing, the stalest trained token)."""
    engine, generate = engine_and_generate(seed=2, rows=30)
    pool = GroupPool(PartialRolloutConfig(oversample=oversample, max_staleness=4), 3, 2, 1, CAP)
    assert pool.capacity * 3 <= engine.max_num_seqs
    if plant:
        plant(pool)
    fewest, stalest, sequence = CAP, 0, iter(range(10**6))
    for step in range(rounds):
        pool.fill([], lambda: group(next(sequence), 3), prompt_ids, rounds - step)
        going = [(s, len(s.completion_ids)) for g in pool.groups for s in g.samples if not s.done]
        for g in pool.round(generate, step):
            stalest = max([stalest] + [step - t for s in g.samples for t in s.steps])
        fewest = min([fewest] + [len(s.completion_ids) - n for s, n in going if not s.done])
        assert pool.metrics([], step)["partial/restarted_samples"] == pool.round_restarts
    return pool, fewest, stalest


@pytest.mark.parametrize("oversample", [2.0, 4.0])
def test_every_sample_in_flight_decodes_every_round_so_nothing_restarts(oversample):
    """With ample KV, every sample in flight gains at least min_decode_steps tokens in every round, even in rounds
    where enough complete groups already wait (at oversample 4 most rounds), so none restarts and no trained token
    is older than max_staleness. A round that lets samples sit idle, or skips its minimum, fails here."""
    pool, fewest, stalest = decode_guarantee_run(oversample)
    assert pool.trained_samples == 12 * 2 * 3 and pool.dropped == 0
    assert fewest >= pool.min_decode_steps == -(-CAP // 5)
    assert stalest <= 4
    assert pool.metrics([], 12)["partial/dropped_stale_frac"] == 0.0
