"""rollout/metrics.py: what drafting costs against a plain decode step (a draft level for the whole batch, per
live-batch bucket), and the seconds speculation saved, reported per drafter in every engine's stats."""
import pytest

from rlspec.rollout import metrics as M
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts


def test_draft_cost_is_one_level_for_the_whole_batch_over_the_plain_step_at_that_batch():
    m = M.RolloutMetrics()
    m.record_verify("off", [0, 0], [0, 0], draft_s=0.0, step_s=0.020)  # bucket 2: 20 ms a plain step
    m.record_verify("off", [0], [0], draft_s=0.0, step_s=0.030)  # bucket 1: 30 ms
    m.record_verify("suffix", [4, 2], [1, 0], draft_s=0.003, step_s=0.040)  # 4 levels in 3 ms at batch 2
    m.record_verify("eagle3", [3], [3], draft_s=0.006, step_s=0.035)  # 3 levels in 6 ms at batch 1
    m.record_verify("eagle3", [4, 4, 4, 1], [0] * 4, draft_s=0.016, step_s=0.05, levels=4)  # batch 4: no plain
    m.record_verify("eagle3", [4], [4], draft_s=0.5, step_s=None)  # a step that captured first: no measure
    s = m.as_dict()
    assert s[M.PLAIN_STEP_MS] == pytest.approx(25.0)  # drafted steps do not count as plain ones
    assert s[f"{M.DRAFT_MS_PER_TOKEN}/suffix"] == pytest.approx(0.5)  # per drafted token, rows summed
    assert s[f"{M.DRAFT_LEVEL_MS}/suffix"] == pytest.approx(0.75)
    assert s[f"{M.DRAFT_COST}/suffix"] == pytest.approx(0.75 / 20)  # a level against batch 2's plain step
    assert s[f"{M.DRAFT_COST}/eagle3/b1"] == pytest.approx(2.0 / 30)
    assert s[f"{M.DRAFT_COST}/eagle3/b4"] == pytest.approx(4.0 / 20)  # borrows the nearest bucket's plain step
    assert s[f"{M.DRAFT_COST}/eagle3"] == pytest.approx((3 * 2.0 / 30 + 4 * 4.0 / 20) / 7)  # weighted by levels
    assert s[f"{M.DRAFT_LEVEL_MS}/eagle3"] == pytest.approx(22.0 / 7)


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


def test_the_fixed_selector_charges_each_depth_its_levels_of_drafting():
    """The selector's drafting input is one level for the whole batch: a proposal of 4 levels in 8 ms costs a
    depth-1 arm 2 ms, not 8 (its gain then reads the per-level figure times the depth); states saved with
    seconds per propose load as per level."""
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.speculation.selectors.longtail import LongTailSelector

    sel = LongTailSelector("suffix", 4)
    for T, secs in ((1, 0.010), (2, 0.010), (3, 0.010), (5, 0.010)):  # verifies as dear as a plain step
        sel.costs.observe(2, T, secs)
    sel.observe(Arm("suffix", 4), 2, 0.010, 0.008, [4, 4], [4, 4])
    assert sel.draft_seconds == {2: pytest.approx(0.002)}
    tokens = sel.acceptance.expected_tokens
    assert sel.gain(2, 1) == pytest.approx(tokens(1) / (1 + 0.2))
    assert sel.gain(2, 4) == pytest.approx(tokens(4) / (1 + 0.8))
    state = sel.state_dict()
    del state["draft_per"]
    state["draft_seconds"] = [[2, 0.008]]  # an older state: seconds per propose
    sel.load_state_dict(state)
    assert sel.draft_seconds == {2: pytest.approx(0.002)}
