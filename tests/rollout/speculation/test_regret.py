"""strategy/regret (selectors/regret.py): the call's seconds against the best fixed arm's estimated seconds
for the same tokens, S / S(a*) - 1. Exact on hand-made ledgers; on the synthetic world of test_selector.py
a selector held on plain decoding where the best arm is known to pay ~2.8x reports about that loss."""
from __future__ import annotations

import random

import pytest

from rlspec.rollout.speculation.selectors.base import OFF, Arm
from rlspec.rollout.speculation.selectors.fixed import FixedSelector
from rlspec.rollout.speculation.selectors.regret import RegretLedger
from tests.rollout.speculation.test_selector import World, calibrated, make

FAST = Arm("suffix", 4)


def test_ledger_regret_by_hand():
    """Bucket 1 (plain step 0.1 s): est OFF 1, FAST 2. Bucket 8 (plain step 0.4 s): OFF 1, FAST 0.5."""
    est = {(OFF, 1): 1.0, (FAST, 1): 2.0, (OFF, 8): 1.0, (FAST, 8): 0.5}
    plain = {1: 0.1, 8: 0.4}.get
    ledger = RegretLedger()
    for _ in range(4):  # bucket 1 played plainly: 4 steps, 1 token each, 0.1 s each
        ledger.record(1, 1, 1, 0.1)
    # S = 0.4; S(OFF) = 0.1 * 4 / 1 = 0.4; S(FAST) = 0.1 * 4 / 2 = 0.2 -> a* = FAST, regret 0.4 / 0.2 - 1 = 1
    assert ledger.regret([OFF, FAST], plain, lambda a, b: est[(a, b)]) == (pytest.approx(1.0), FAST)
    ledger.record(8, 8, 16, 0.8)  # bucket 8: 2 tokens per row in 0.8 s (FAST played there: 2 plain steps)
    # S = 1.2; S(OFF) = 0.4 + 0.4 * 2 / 1 = 1.2; S(FAST) = 0.2 + 0.4 * 2 / 0.5 = 1.8 -> a* = OFF, regret 0
    assert ledger.regret([OFF, FAST], plain, lambda a, b: est[(a, b)]) == (pytest.approx(0.0), OFF)
    ledger.clear()
    for _ in range(2):  # per bucket the best arm, each step exactly as estimated: better than any single arm
        ledger.record(1, 1, 2, 0.1)
    ledger.record(8, 8, 8, 0.4)
    # S = 0.6; S(OFF) = 0.1 * 4 + 0.4 * 1 = 0.8; S(FAST) = 0.1 * 4 / 2 + 0.4 / 0.5 = 1.0 -> regret 0.6 / 0.8 - 1
    assert ledger.regret([OFF, FAST], plain, lambda a, b: est[(a, b)]) == (pytest.approx(-0.25), OFF)
    assert RegretLedger().regret([OFF], plain, lambda a, b: 1.0) is None


def test_an_unknown_plain_cost_counts_the_measured_seconds_on_both_sides():
    ledger = RegretLedger()
    ledger.record(2, 2, 4, 0.3)
    assert ledger.regret([OFF, FAST], lambda b: None, lambda a, b: 3.0) == (pytest.approx(0.0), OFF)


def learned(world: World, B: int, rng: random.Random):
    """A selector that has played batch B for a while, at the start of a new call."""
    sel = make(world)
    for _ in range(1500):
        world.step(sel, B, rng)
    sel.begin_call()
    return sel


def test_a_selector_held_on_plain_decoding_reports_what_the_best_arm_would_have_saved():
    world, rng = World(noise=0.02), random.Random(5)
    best = world.best(make(world).arms, 2)
    speedup = world.true_speedup(best, 2)
    assert speedup > 1.4  # the world's best arm at B = 2 pays well
    sel = learned(world, 2, rng)
    sel.choose = lambda batch: OFF  # what forcing an arm does; observe still runs
    for _ in range(300):
        world.step(sel, 2, rng)
    m = sel.metrics()
    assert m["strategy/regret"] == pytest.approx(speedup - 1, rel=0.2), (m["strategy/regret"], speedup)
    assert world.true_speedup(sel.arms[int(m["strategy/best_fixed_arm"])], 2) >= 0.9 * speedup


def test_a_selector_left_to_choose_has_little_regret():
    world, rng = World(noise=0.02), random.Random(6)
    sel = learned(world, 2, rng)
    for _ in range(300):
        world.step(sel, 2, rng)
    assert abs(sel.metrics()["strategy/regret"]) < 0.1, sel.metrics()["strategy/regret"]


def test_the_fixed_selector_reports_regret_too():
    world = World()
    sel = FixedSelector("suffix", 4)
    sel.costs = calibrated(world, [Arm("suffix", d) for d in sel.depths()])
    rng = random.Random(8)
    for _ in range(200):
        world.step(sel, 2, rng)
    sel.begin_call()
    sel.choose = lambda batch: OFF
    for _ in range(100):
        world.step(sel, 2, rng)
    m = sel.metrics()
    assert m["strategy/regret"] > 0.2 and m["strategy/best_fixed_depth"] > 0
