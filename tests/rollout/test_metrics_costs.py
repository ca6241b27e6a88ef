"""What a drafted token costs against a plain decode step, and the seconds speculation saved: read from the
speculation ledger (rollout/speculation/ledger.py) into every engine's stats (rollout/metrics.py's ledger_metrics),
summed across a Ray pool's workers."""
import pytest

from rlspec.rollout import metrics as M
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.ledger import Ledger
from rlspec.rollout.speculation.selectors.base import OFF, Arm
from rlspec.rollout.types import SamplingParams, SpecConfig
from rlspec.rollout.workers.stats import merge_stats
from tests.conftest import make_tiny_hf, random_prompts


def test_draft_cost_is_one_level_for_the_whole_batch_over_the_plain_step_at_that_batch():
    """A verify of k drafts pays k draft levels beside the verify: the cost of one level, for the live batch, in
    plain steps of that live batch (not per drafted token summed over rows, not over the window's mean step)."""
    led = Ledger()
    led.record(OFF, 2, 0.020, 0.0, [0, 0], [0, 0])
    led.record(OFF, 1, 0.030, 0.0, [0], [0])
    led.record(Arm("suffix", 4), 2, 0.040, 0.003, [4, 2], [1, 0])  # 6 tokens in 3 ms
    led.record(Arm("eagle3", 3), 1, 0.035, 0.006, [3], [3])  # 3 tokens in 6 ms
    s = M.ledger_metrics(led.take_window())
    assert s[M.PLAIN_STEP_MS] == pytest.approx(25.0)  # drafted steps do not count as plain ones
    assert s[f"{M.DRAFT_MS_PER_TOKEN}/suffix"] == pytest.approx(0.5)
    assert s[f"{M.DRAFT_LEVEL_MS}/suffix"] == pytest.approx(0.75)  # 3 ms over 4 levels
    assert s[f"{M.DRAFT_COST}/suffix"] == pytest.approx(0.75 / 20)  # bucket 2's plain step: 20 ms
    assert s[f"{M.DRAFT_COST}/eagle3"] == pytest.approx(2.0 / 30)  # 6 ms over 3 levels; bucket 1's: 30 ms
    assert s[f"{M.ACCEPT_RATE}/suffix"] == pytest.approx(1 / 6) and s[f"{M.ACCEPT_LEN}/eagle3"] == 4.0
    assert M.ledger_metrics(led.take_window()) == {}  # each read covers the steps since the last one


def test_speculation_saved_seconds_count_positions_advanced_at_the_buckets_plain_step_time():
    led = Ledger()
    led.record(OFF, 2, 0.020, 0.0, [0, 0], [0, 0])  # bucket 2: 20 ms a plain step
    led.record(OFF, 8, 0.080, 0.0, [0] * 8, [0] * 8)  # bucket 8: 80 ms
    assert M.SPEC_SAVED_S not in M.ledger_metrics(led.take_window())  # nothing speculated
    # two rows, 3 + 1 accepted: the batch advanced (4 + 2) / 2 = 3 positions = 60 ms of plain steps, in 35 ms
    led.record(Arm("suffix", 4), 2, 0.030, 0.005, [4, 2], [3, 1])
    assert led.saved == pytest.approx(0.060 - 0.035)
    # one row (bucket 1, no plain steps: borrows bucket 2's 20 ms), nothing accepted: 20 ms of progress in 50 ms
    led.record(Arm("eagle3", 3), 1, 0.040, 0.010, [3], [0])
    window = M.ledger_metrics(led.take_window())
    assert window[M.SPEC_SAVED_S] == pytest.approx(0.025 - 0.030) == led.saved  # the loss guard's S, once
    assert led.plain_time == pytest.approx(0.100 + 0.060 + 0.020)


def test_a_pool_sums_the_seconds_its_workers_saved():
    """Each worker's rollout/spec_saved_s is its own decode time saved: the pool saved their sum, whatever the
    workers' shares of the samples (a weighted mean would report 0.2 here)."""
    workers = [{M.SPEC_SAVED_S: 1.0, M.NUM_SEQUENCES: 1.0, "strategy/reason/selector": 10.0},
               {M.SPEC_SAVED_S: -0.25, M.NUM_SEQUENCES: 3.0, "strategy/reason/selector": 30.0}]
    merged = merge_stats(workers, wall_s=2.0)
    assert merged[M.SPEC_SAVED_S] == pytest.approx(0.75)
    assert merged["strategy/reason/selector"] == 40.0  # steps, counted on every worker


def test_the_engine_reports_each_drafters_cost():
    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama")), None, eos_token_ids=[2],
                        spec=SpecConfig(drafter="suffix", num_draft_tokens=3), compile_mode="off")
    prompts = random_prompts(4, 3, 12, seed=1)
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))  # off at first: plain steps
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))  # repeats: suffix drafts
    s = eng.stats()
    assert s[M.PLAIN_STEP_MS] > 0
    assert 0 < s[f"{M.DRAFT_COST}/suffix"] < 10


@pytest.mark.parametrize("ahead", [False, True], ids=["step_by_step", "looked_ahead"])
def test_steps_that_captured_their_graph_count_their_acceptance_not_their_time(monkeypatch, ahead):
    """A step whose shape was captured first (on CUDA, each bucket's first step) measures no cost, but its drafts
    were verified like any other's: the drafter's acceptance counts it, so with every step such a step the
    drafter's figures are the call's (as with none), and nothing of its time is read (no plain step, no draft
    cost). Step by step and with chains looked ahead (ngram_device)."""
    from rlspec.rollout.runtime.graphs import EagerRunner

    def run(fresh: bool) -> dict:
        monkeypatch.setattr(EagerRunner, "fresh", fresh)
        eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama")), None, eos_token_ids=[2],
                            spec=SpecConfig(drafter="ngram_device", num_draft_tokens=3, selector="always",
                                            online_training=False), compile_mode="off")
        eng.look_ahead = ahead
        eng.generate(random_prompts(4, 3, 12, seed=1), SamplingParams(temperature=0, max_new_tokens=24))
        return eng.stats()

    timed, untimed = run(False), run(True)
    for s in (timed, untimed):
        assert s[M.ACCEPT_RATE] > 0 and s[f"{M.ACCEPT_RATE}/ngram_device"] == pytest.approx(s[M.ACCEPT_RATE])
        assert s[f"{M.ACCEPT_LEN}/ngram_device"] == pytest.approx(s[M.ACCEPT_LEN])
    assert untimed[M.ACCEPT_RATE] == timed[M.ACCEPT_RATE] and (timed[M.AHEAD_SHARE] > 0) == ahead
    assert f"{M.DRAFT_COST}/ngram_device" in timed and f"{M.DRAFT_MS_PER_TOKEN}/ngram_device" in timed
    assert not any(k.startswith((M.DRAFT_COST, M.DRAFT_MS_PER_TOKEN, M.PLAIN_STEP_MS)) for k in untimed)
