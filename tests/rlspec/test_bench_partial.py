"""`python -m rlspec.bench partial`'s reduction of what each arm's trainer logged into its row and ratios (the run
itself: the `partial` smoke case of test_bench.py)."""
from __future__ import annotations

import argparse

import pytest

from rlspec.bench.partial import run_metrics, summarize


def _step(wall, sync, length, **partial):
    return {"rollout/wall_s": wall, "rollout/sync_s": sync, "completions/mean_length": length, "reward": 0.5,
            **{f"partial/{k}": v for k, v in partial.items()}}


def test_run_metrics_reads_the_trainers_log_step_by_step():
    history = [_step(3.0, 1.0, 100.0, dropped_stale_frac=0.0, carried_samples=0.0, on_policy_token_frac=1.0),
               # a step whose round found its groups complete generates nothing: no rollout timings logged
               {"completions/mean_length": 300.0, "reward": 0.5, "partial/dropped_stale_frac": 0.25,
                "partial/carried_samples": 4.0, "partial/on_policy_token_frac": 0.5},
               {"train_runtime": 9.0}]  # TRL's closing entry, not a step
    m = run_metrics(history)
    assert m["rollout_s"] == [2.0]  # the weight sync apart
    assert m["trained_len"] == 200.0 and m["carried_samples"] == 2.0 and m["on_policy_token_frac"] == 0.75
    assert m["dropped_stale_frac"] == 0.25  # the last step's: a running fraction
    assert m["staleness_mean"] is None  # not logged: None, not 0


def _arm(wall, rollout_s, length, carried=None, steps=None):
    return {"wall_s": wall, "rollout_s": rollout_s, "trained_len": length, "carried_samples": carried,
            "decode_steps": steps}


def test_summary_ratios_pair_each_on_arm_with_its_off_arm_per_repetition():
    runs = {"off/plain": [_arm(10.0, [2.0, 2.0], 100.0, steps=900), _arm(20.0, [4.0, 4.0], 100.0, steps=800)],
            "on/plain": [_arm(8.0, [1.0], 150.0, 2.0, 300), _arm(10.0, [3.0], 150.0, 2.0, 400)],
            "on/spec": [_arm(5.0, [1.0, 1.0], 120.0, 1.0), _arm(5.0, [1.0, 1.0], 120.0, 1.0)]}
    report = summarize(runs, argparse.Namespace(steps=2, smoke=False))
    rows = {r["arm"]: r for r in report["rows"]}
    # rollout seconds per step of the run, not per logged rollout: the on arm generated in one step of two
    assert rows["on/plain"]["rollout_s_per_step"] == pytest.approx(1.0)  # median of 0.5 and 1.5
    assert rows["on/plain"]["wall_off_over_on"] == pytest.approx(1.625)  # median of 10/8 and 20/10
    assert rows["on/plain"]["len_on_over_off"] == pytest.approx(1.5)
    assert rows["on/plain"]["steps_off_over_on"] == pytest.approx(2.5)  # median of 900/300 and 800/400
    assert report["ratios"] == {"wall_off_over_on/plain": pytest.approx(1.625), "len_on_over_off/plain": 1.5,
                                "steps_off_over_on/plain": pytest.approx(2.5)}
    assert "wall_off_over_on" not in rows["on/spec"]  # no off/spec arm ran: no ratio, rather than a wrong one
    assert rows["off/plain"]["carried_samples"] is None
