"""Run summary: per-step rollout time vs step time, reward and throughput, and the table a run ends with.

The metrics themselves reach W&B through the trainer's own metric store (SpecGRPOTrainer appends
them to `self._metrics`); this callback only reads each logged record back to keep a small table,
so a run can say what share of its step time went to rollouts.
"""
from __future__ import annotations

from transformers import TrainerCallback

import rlspec.rollout.metrics as M

# Row field -> the logged key it comes from (TRL's names for reward and step time, ours for rollouts).
ROW_KEYS = {
    "reward": "reward",
    "rollout_s": M.WALL_S,
    "step_s": "step_time",
    "tokens_per_s": M.TOKENS_PER_S,
    "mean_len": M.MEAN_LEN,
    "accept_len": M.ACCEPT_LEN,
    "spec_saved_s": M.SPEC_SAVED_S,
    "drafter_version": "drafter/version",
    # partial rollouts only (trainers/partial_rollouts.py): the table shows them when a run logged them
    "carried": "partial/carried_samples",
    "on_policy": "partial/on_policy_token_frac",
}


class RolloutSummaryCallback(TrainerCallback):
    """Keeps one row per training log record: step, reward, rollout_s, step_s, rollout_share, tokens_per_s,
    accept_len (tokens per verify, 1.0 without speculation), spec_saved_s (decode seconds speculation saved
    against plain steps, negative when it lost; rollout/metrics.py) and drafter_version (learned drafter).

    With logging_steps=1 a row is one optimizer step; with logging_steps=N it is the mean over the N
    steps ending at `step` (TRL averages its metric store per log call).
    """

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" not in logs and M.WALL_S not in logs:
            return  # eval records and the end-of-training summary carry no rollout metrics
        row = {"step": state.global_step}
        row.update({field: _number(logs.get(key)) for field, key in ROW_KEYS.items()})
        rollout_s, step_s = row["rollout_s"], row["step_s"]
        row["rollout_share"] = rollout_s / step_s if rollout_s is not None and step_s else None
        self.rows.append(row)


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _sum(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _total_row(rows: list[dict]) -> dict:
    """Means for reward and tok/s, sums for times, and the run's overall rollout share of step time."""
    timed = [r for r in rows if r["rollout_s"] is not None and r["step_s"]]
    rollout = sum(r["rollout_s"] for r in timed)
    step = sum(r["step_s"] for r in timed)
    return {
        "step": "all",
        "reward": _mean([r["reward"] for r in rows]),
        "rollout_s": rollout if timed else None,
        "step_s": step if timed else None,
        "rollout_share": rollout / step if timed else None,
        "tokens_per_s": _mean([r["tokens_per_s"] for r in rows]),
        "accept_len": _mean([r.get("accept_len") for r in rows]),
        "spec_saved_s": _sum([r.get("spec_saved_s") for r in rows]),
        "drafter_version": rows[-1].get("drafter_version"),
        "carried": _sum([r.get("carried") for r in rows]),
        "on_policy": _mean([r.get("on_policy") for r in rows]),
    }


def format_summary_table(rows: list[dict]) -> str:
    """A plain-text table of the rows plus an "all" line (rollout share = total rollout s / total step s)."""
    partial = any(r.get("carried") is not None for r in rows)
    header = (f"{'step':>5} {'reward':>7} {'rollout s':>10} {'step s':>8} {'rollout %':>10} {'tok/s':>8} "
              f"{'accepted':>9} {'spec saved s':>12} {'drafter v':>9}")
    header += f" {'carried':>8} {'on-policy %':>11}" if partial else ""
    rule = "-" * len(header)
    if not rows:
        return "\n".join([header, rule, "(no training steps logged)"])
    lines = [header, rule, *(_format_row(row, partial) for row in rows), rule,
             _format_row(_total_row(rows), partial)]
    return "\n".join(lines)


def _format_row(row: dict, partial: bool = False) -> str:
    share = None if row.get("rollout_share") is None else 100 * row["rollout_share"]
    line = (
        f"{row['step']!s:>5} {_cell(row.get('reward'), '.3f'):>7} {_cell(row.get('rollout_s'), '.2f'):>10} "
        f"{_cell(row.get('step_s'), '.2f'):>8} {_cell(share, '.1f'):>10} {_cell(row.get('tokens_per_s'), '.1f'):>8} "
        f"{_cell(row.get('accept_len'), '.2f'):>9} {_cell(row.get('spec_saved_s'), '+.2f'):>12} "
        f"{_cell(row.get('drafter_version'), '.0f'):>9}"
    )
    if partial:  # carried samples trained at the step, and the share of its tokens the current policy drew
        on_policy = None if row.get("on_policy") is None else 100 * row["on_policy"]
        line += f" {_cell(row.get('carried'), '.0f'):>8} {_cell(on_policy, '.1f'):>11}"
    return line


def attach_summary_callback(trainer) -> RolloutSummaryCallback:
    """The RolloutSummaryCallback the caller passed in callbacks=[...], else a new one added to `trainer`."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, RolloutSummaryCallback):
            return callback
    callback = RolloutSummaryCallback()
    trainer.add_callback(callback)
    return callback
