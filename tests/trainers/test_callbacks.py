"""rlspec.trainers.callbacks: per-step rows from the trainer's log records and the summary table."""
from __future__ import annotations

from types import SimpleNamespace

from rlspec.trainers.callbacks import RolloutSummaryCallback, format_summary_table


def _log(callback, step, logs):
    callback.on_log(args=None, state=SimpleNamespace(global_step=step), control=None, logs=logs)


def test_rows_from_training_logs_only():
    callback = RolloutSummaryCallback()
    _log(callback, 1, {"reward": 0.25, "rollout/wall_s": 3.0, "step_time": 4.0, "rollout/tokens_per_s": 100.0})
    _log(callback, 2, {"reward": 0.5, "rollout/wall_s": 1.0, "step_time": 4.0})
    _log(callback, 2, {"eval_loss": 1.0})  # eval record: no rollout metrics, no row
    _log(callback, 2, {"train_runtime": 9.0, "train_loss": 0.1})
    assert [row["step"] for row in callback.rows] == [1, 2]
    first = callback.rows[0]
    assert first["reward"] == 0.25 and first["rollout_share"] == 0.75 and first["tokens_per_s"] == 100.0
    assert callback.rows[1]["tokens_per_s"] is None


def test_summary_table_has_rows_and_an_overall_share():
    rows = [
        {"step": 1, "reward": 0.25, "rollout_s": 3.0, "step_s": 4.0, "rollout_share": 0.75, "tokens_per_s": 100.0},
        {"step": 2, "reward": 0.5, "rollout_s": 1.0, "step_s": 4.0, "rollout_share": 0.25, "tokens_per_s": None},
    ]
    table = format_summary_table(rows)
    lines = table.splitlines()
    assert "rollout %" in lines[0] and len(lines) == 6
    total = lines[-1].split()
    assert total[0] == "all" and total[1] == "0.375" and total[4] == "50.0"  # (3 + 1) / (4 + 4)
    assert "no training steps" in format_summary_table([])


def test_the_summary_says_whether_speculation_paid():
    callback = RolloutSummaryCallback()
    _log(callback, 1, {"reward": 0.0, "rollout/wall_s": 3.0, "step_time": 4.0, "rollout/spec_saved_s": -0.5})
    _log(callback, 2, {"reward": 0.0, "rollout/wall_s": 2.0, "step_time": 3.0, "rollout/spec_saved_s": 1.25})
    lines = format_summary_table(callback.rows).splitlines()
    assert "spec saved s" in lines[0]
    assert "-0.50" in lines[2] and "+1.25" in lines[3] and "+0.75" in lines[-1]  # the run's total


def test_a_partial_rollouts_run_shows_carried_samples_and_the_on_policy_share():
    cb = RolloutSummaryCallback()
    args, state = SimpleNamespace(), SimpleNamespace(global_step=1)
    cb.on_log(args, state, None, logs={"reward": 0.5, "rollout/wall_s": 2.0, "step_time": 4.0,
                                       "partial/carried_samples": 3.0, "partial/on_policy_token_frac": 0.75})
    state.global_step = 2
    cb.on_log(args, state, None, logs={"reward": 0.5, "step_time": 1.0, "partial/carried_samples": 5.0,
                                       "partial/on_policy_token_frac": 0.25})
    table = format_summary_table(cb.rows).splitlines()
    assert "carried" in table[0] and "on-policy %" in table[0]
    assert table[-1].split()[-2:] == ["8", "50.0"]  # carried summed over the run, the on-policy share averaged
    assert "carried" not in format_summary_table([{**r, "carried": None, "on_policy": None} for r in cb.rows])
