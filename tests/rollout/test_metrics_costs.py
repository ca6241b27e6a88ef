"""rollout/metrics.py: what a drafted token costs, against a plain decode step (issue 27's "a drafter token
costs <= 5% of a target step", reported per drafter in every engine's stats)."""
import pytest

from rlspec.rollout import metrics as M
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts


def test_draft_cost_is_draft_time_per_token_over_the_plain_step():
    m = M.RolloutMetrics()
    m.record_verify("off", [0, 0], [0, 0], draft_s=0.0, step_s=0.020)
    m.record_verify("off", [0], [0], draft_s=0.0, step_s=0.030)
    m.record_verify("suffix", [4, 2], [1, 0], draft_s=0.003, step_s=0.040)  # 6 tokens in 3 ms
    m.record_verify("eagle3", [3], [3], draft_s=0.006, step_s=0.035)  # 3 tokens in 6 ms
    s = m.as_dict()
    assert s[M.PLAIN_STEP_MS] == pytest.approx(25.0)  # drafted steps do not count as plain ones
    assert s[f"{M.DRAFT_MS_PER_TOKEN}/suffix"] == pytest.approx(0.5)
    assert s[f"{M.DRAFT_COST}/suffix"] == pytest.approx(0.02)
    assert s[f"{M.DRAFT_COST}/eagle3"] == pytest.approx(0.08)


def test_speculation_saved_seconds_count_positions_advanced_at_the_buckets_plain_step_time():
    m = M.RolloutMetrics()
    m.record_verify("off", [0, 0], [0, 0], step_s=0.020)  # bucket 2: 20 ms a plain step
    m.record_verify("off", [0] * 8, [0] * 8, step_s=0.080)  # bucket 8: 80 ms
    assert M.SPEC_SAVED_S not in m.as_dict()  # nothing speculated
    # two rows, 3 + 1 accepted: the batch advanced (4 + 2) / 2 = 3 positions = 60 ms of plain steps, in 35 ms
    m.record_verify("suffix", [4, 2], [3, 1], draft_s=0.005, step_s=0.030)
    assert m.as_dict()[M.SPEC_SAVED_S] == pytest.approx(0.060 - 0.035)
    # one row (bucket 1, no plain steps: borrows bucket 2's 20 ms), nothing accepted: 20 ms of progress in 50 ms
    m.record_verify("eagle3", [3], [0], draft_s=0.010, step_s=0.040)
    assert m.as_dict()[M.SPEC_SAVED_S] == pytest.approx(0.025 - 0.030)
    # a step that compiled its shape (step_s None) is no measure either way
    m.record_verify("suffix", [2, 2], [2, 2], draft_s=0.001, step_s=None)
    assert m.as_dict()[M.SPEC_SAVED_S] == pytest.approx(-0.005)


def test_the_engine_reports_each_drafters_cost():
    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama")), None, eos_token_ids=[2],
                        spec=SpecConfig(drafter="suffix", num_draft_tokens=3), compile_mode="off")
    prompts = random_prompts(4, 3, 12, seed=1)
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))  # off at first: plain steps
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))  # repeats: suffix drafts
    s = eng.stats()
    assert s[M.PLAIN_STEP_MS] > 0
    assert 0 < s[f"{M.DRAFT_COST}/suffix"] < 10
