"""Tasks, seeds and merged metrics of the Ray pool, without Ray (rollout/workers/tasks.py, stats.py)."""
from __future__ import annotations

import pytest

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.types import SamplingParams
from rlspec.rollout.workers.stats import merge_stats
from rlspec.rollout.workers.tasks import generate_in_tasks, split, task_seed
from tests.conftest import make_tiny_hf, random_prompts

PROMPTS = random_prompts(5, 4, 10, seed=7)


def test_task_seeds_are_fixed_distinct_and_task_0_keeps_the_call_s():
    assert task_seed(7, 0) == 7 and task_seed(None, 3) is None
    assert task_seed(7, 1) == 2174948161648732372  # blake2b of '7/1': the same on every machine and run
    assert len({task_seed(7, 1), task_seed(7, 2), task_seed(8, 1), 7}) == 4


def test_tasks_hold_whole_groups_in_prompt_order():
    params = SamplingParams(n=3, seed=1)
    tasks = split(PROMPTS, params, 2)
    assert [(t.index, t.first, len(t.prompts)) for t in tasks] == [(0, 0, 2), (1, 2, 2), (2, 4, 1)]
    assert tasks[0].params.seed == 1 and tasks[1].params.seed == task_seed(1, 1) and tasks[1].params.n == 3
    with pytest.raises(ValueError, match="groups_per_task must be >= 1"):
        split(PROMPTS, params, 0)


def test_one_task_is_the_engine_itself_and_tasks_come_back_prompt_major():
    engine = RolloutEngine.from_hf_model(make_tiny_hf("llama", seed=2), None, max_model_len=64, max_num_seqs=8)
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=9, ignore_eos=True)
    whole = generate_in_tasks(engine, PROMPTS, params, groups_per_task=len(PROMPTS))
    assert [(r.completion_ids, r.logprobs) for r in whole] == \
        [(r.completion_ids, r.logprobs) for r in engine.generate(PROMPTS, params)]
    split_up = generate_in_tasks(engine, PROMPTS, params, groups_per_task=2)
    assert [(r.prompt_index, r.sample_index) for r in split_up] == [(i, j) for i in range(5) for j in range(2)]
    assert [r.prompt_ids for r in split_up] == [p for p in PROMPTS for _ in range(2)]


def test_worker_metrics_add_counts_keep_peaks_and_weigh_rates_by_samples():
    a = {"rollout/generated_tokens": 100.0, "rollout/num_sequences": 4.0, "rollout/max_len": 40.0,
         "rollout/accept_len": 2.0, "rollout/time_s": 3.0}
    b = {"rollout/generated_tokens": 20.0, "rollout/num_sequences": 1.0, "rollout/max_len": 20.0,
         "rollout/accept_len": 1.0, "rollout/time_s": 1.0}
    m = merge_stats([a, b], wall_s=4.0)
    assert m["rollout/generated_tokens"] == 120 and m["rollout/num_sequences"] == 5 and m["rollout/max_len"] == 40
    assert m["rollout/accept_len"] == pytest.approx((2.0 * 4 + 1.0) / 5)
    assert m["rollout/tokens_per_s"] == 30 and m["rollout/time_s"] == 4 and m["workers/busy_share"] == 0.5
