"""The ledger (rollout/speculation/ledger.py): one record of what speculation costs and saves, written once per
step, with the views every reader prices a step by, and the one bucket function."""
from __future__ import annotations

import pytest

from rlspec.rollout.speculation.buckets import bucket, nearest_bucket, reachable_buckets
from rlspec.rollout.speculation.ledger import Ledger, legacy_ledger_state
from rlspec.rollout.speculation.selectors.base import OFF, Arm


def test_one_bucket_function():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 60, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 64, 128]
    assert reachable_buckets(60) == [1, 2, 4, 8, 16, 32, 64] == reachable_buckets(64)
    assert reachable_buckets(1) == [1]
    assert nearest_bucket([1, 8], 4) == 8 and nearest_bucket([2, 8], 4) == 2  # in powers of two; a tie: smaller


def test_plain_step_time_is_one_record_with_two_named_views():
    """The cost model's view (EMA 0.2 over every step one token wide, seeded by calibration) and the settled view
    the loss guard prices progress with (EMA 0.1 over plain steps) are kept from the same steps by one writer."""
    led = Ledger()
    led.record(OFF, 3, 0.010, 0.0, [0, 0, 0], [0, 0, 0])
    led.record(OFF, 4, 0.020, 0.0, [0] * 4, [0] * 4)
    assert led.plain(4) == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)
    assert led.plain_seconds(4) == pytest.approx(0.010 + 0.1 * 0.010)
    assert led.plain_seconds(2) == pytest.approx(led.plain_seconds(4))  # an unmeasured bucket borrows the nearest
    assert led.plain_time == pytest.approx(0.030) and led.saved == 0.0


def test_a_speculative_step_files_its_cost_drafting_acceptance_and_savings_once():
    led = Ledger()
    led.record(OFF, 2, 0.020, 0.0, [0, 0], [0, 0])
    led.record(Arm("suffix", 4), 2, 0.030, 0.004, [4, 2], [4, 1])
    assert led.costs.table[(2, 5)] == 0.030  # verify cost by the width it verified
    assert led.draft_level[("suffix", 2)] == pytest.approx(0.001)  # 4 ms over 4 levels
    tr = led.acceptance["suffix"]
    assert (tr.accepts, tr.rejects) == (5.0, 1.0) and led.trials["suffix"] == 6.0 and led.fresh["suffix"] == (5, 1)
    assert led.saved == pytest.approx((5 + 2) / 2 * 0.020 - 0.034)


def test_the_record_round_trips_and_old_selector_states_still_load():
    led = Ledger()
    led.record(OFF, 2, 0.020, 0.0, [0, 0], [0, 0])
    led.record(Arm("suffix", 4), 2, 0.030, 0.004, [4, 2], [4, 1])
    again = Ledger()
    again.load_state_dict(led.state_dict())
    assert again.state_dict() == led.state_dict()
    old = {"kind": "adaptive", "shape": [], "costs": led.costs.state_dict(),
           "acceptance": [["suffix", led.acceptance["suffix"].state_dict()]],
           "draft_level": [["suffix", 2, 0.001]], "fresh": [["suffix", 5.0, 1.0]],
           "guard": {"alpha": 0.02, "saved": 0.5, "plain_time": 2.0, "held": 1, "plain_step": [[2, 0.02]]}}
    legacy = Ledger()
    legacy.load_state_dict(legacy_ledger_state(old))
    assert legacy.saved == 0.5 and legacy.plain_settled == {2: 0.02} and legacy.costs.table == led.costs.table
    assert legacy.acceptance["suffix"].rate == led.acceptance["suffix"].rate
