"""PPO with speculation on vs off: `python -m rlspec.train config=ppo_math.yaml` twice, same seed, same steps.

With the config's drafter (speculation on) and with `drafter.drafter=none` (off), each in its own process, then
compared from each run's summary.json: total wall time, rollout-phase seconds and tokens/s, final reward (mean of
the last 5 steps), the importance-sampling ratio, the critic's out-of-sample error pooled over windows of steps
(against predicting each rollout's mean return, and against a running mean of past returns), and per step the
reward, the value loss and the rollout seconds (the PNG). The acceptance check: rollouts faster with
speculation, final reward within noise, value loss falling, IS ratio ~1.

    python -m rlspec.bench ppo --steps 30
    python -m rlspec.bench ppo --runs spec_on --overrides ppo.value_model=separate   # a critic variant alone
"""
from __future__ import annotations

import sys
from pathlib import Path

from rlspec.bench import harness
from rlspec.bench.common import rollout_seconds, smoke_train, summary_of, train_run

NAME = "ppo"
HELP = "end-to-end PPO with speculation on vs off: time, reward, value loss, the critic's out-of-sample error"


def add_arguments(p) -> None:
    p.add_argument("--config", default="ppo_math.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workdir", default="outputs/bench_ppo")
    p.add_argument("--drafter", default=None, help="the speculating run's drafter (default: the config's)")
    p.add_argument("--overrides", nargs="*", default=[], help="extra key=value for both runs (not drafter.drafter)")
    p.add_argument("--reuse", action="store_true", help="keep runs that already finished in --workdir")
    p.add_argument("--runs", nargs="+", choices=["spec_on", "spec_off"], default=["spec_on", "spec_off"],
                   help="spec_on alone: a critic variant (--overrides) judged with speculation on, at half the time")


WINDOW = 10  # steps pooled for the critic's out-of-sample error
LAST = 5  # the final reward is the mean over this many last steps (one step's 8 samples are noisy)


def _series(summary: dict, key: str) -> list[tuple[int, float]]:
    rows = summary["history"]
    if key == "val/explained_variance":  # undefined where every return was equal (runs logged before the NaN)
        rows = [h for h in rows if h.get("val/returns_var", 1.0) >= 1e-8]
    return [(h["step"], h[key]) for h in rows if h.get(key) is not None]


def _mean(values: list) -> float | None:
    values = [v for v in values if v == v]  # NaN: a metric undefined at that step
    return sum(values) / len(values) if values else None


def result_row(label: str, s: dict) -> dict:
    """One table row from a run's summary.json."""
    rewards = [v for _, v in _series(s, "reward")]
    ratio = [v for _, v in _series(s, "sampling/importance_sampling_ratio/mean")]
    tokens = sum(h.get("rollout/generated_tokens", 0) for h in s["history"])
    rollout_s = rollout_seconds(s)
    return {"run": label, "drafter": s["config"]["drafter"]["drafter"], "wall_s": s["wall_s"], "rollout_s": rollout_s,
            "rollout_tok_s": tokens / rollout_s if rollout_s else None, "reward_first": rewards[0] if rewards else None,
            f"reward_last{LAST}": _mean(rewards[-LAST:]), "is_ratio_mean": _mean(ratio),
            "value_loss_first": next(iter(_series(s, "loss/value")), (None, None))[1],
            "value_loss_last": (_series(s, "loss/value") or [(None, None)])[-1][1],
            f"value_loss_first{LAST}": _mean([v for _, v in _series(s, "loss/value")][:LAST]),
            f"value_loss_last{LAST}": _mean([v for _, v in _series(s, "loss/value")][-LAST:]),
            f"explained_var_first{LAST}": _mean([v for _, v in _series(s, "val/explained_variance")][:LAST]),
            f"explained_var_last{LAST}": _mean([v for _, v in _series(s, "val/explained_variance")][-LAST:]),
            f"value_error_first{WINDOW}": _pooled_error(s, slice(0, WINDOW)),
            f"value_error_last{WINDOW}": _pooled_error(s, slice(-WINDOW, None)),
            f"critic_vs_running_mean_first{WINDOW}": _vs_running_mean(s, slice(0, WINDOW)),
            f"critic_vs_running_mean_last{WINDOW}": _vs_running_mean(s, slice(-WINDOW, None))}


def _pooled_error(summary: dict, steps: slice) -> float | None:
    """sum(val/mse) / sum(val/returns_var) over `steps`: the critic's squared error on fresh rollouts (before
    it trains on them) relative to predicting each rollout's mean return; 1 - this is the out-of-sample
    explained variance, pooled over steps because one step's 8 completions make a per-step ratio noise.
    It falls when the critic learns, whatever the reward's own variance does."""
    mse = [v for _, v in _series(summary, "val/mse")][steps]
    var = [v for _, v in _series(summary, "val/returns_var")][steps]
    return sum(mse) / sum(var) if mse and sum(var) > 0 else None


def _vs_running_mean(summary: dict, steps: slice, width: int = LAST) -> float | None:
    """The critic's pooled error over `steps` divided by that of the simplest baseline, a constant b =
    the mean return of the previous `width` rollouts (what a critic that learned only the average
    outcome would predict). Its error on a rollout is returns_var + (returns_mean - b)^2, computed
    from the same token-weighted statistics as val/mse. Below 1: the critic knows more than the
    running average; ~1: it has learned the mean and nothing per prompt or per completion. The first
    rollout (no history) is left out."""
    rows = [h for h in summary["history"] if h.get("val/mse") is not None and h.get("val/returns") is not None]
    pairs = []
    for i, h in enumerate(rows[1:], start=1):
        prev = rows[max(0, i - width):i]
        b = sum(r["val/returns"] for r in prev) / len(prev)
        pairs.append((h["val/mse"], h["val/returns_var"] + (h["val/returns"] - b) ** 2))
    pairs = pairs[steps]
    base = sum(x for _, x in pairs)
    return sum(m for m, _ in pairs) / base if pairs and base > 0 else None


def _rolling_pooled_error(summary: dict, width: int = 5) -> list[tuple[int, float]]:
    """(step, _pooled_error over the `width` steps ending there), for the plot."""
    steps = [step for step, _ in _series(summary, "val/mse")]
    points = [(steps[end - 1], _pooled_error(summary, slice(end - width, end))) for end in range(width, len(steps) + 1)]
    return [(step, value) for step, value in points if value is not None]


def train(label: str, drafter: str, args) -> dict:
    out = Path(args.workdir) / label
    done = summary_of(out) if args.reuse else None
    if done is not None and done.get("status") == "finished":
        print(f"[bench ppo] reusing the finished run in {out}", flush=True)
        return done
    smoke = smoke_train(args.workdir, "ppo") if args.smoke else []
    # train_run also sets grpo.max_steps, which a ppo run ignores: the ppo keys go here
    return train_run("bench ppo", out, args.config, args.steps, [f"ppo.max_steps={args.steps}", "ppo.save_steps=1000",
                                                                 f"drafter.drafter={drafter}", *smoke,
                                                                 *args.overrides], in_process=args.smoke)


def run(args) -> dict:
    if args.smoke:
        args.steps, args.workdir = 1, str(Path(args.out).with_suffix("")) + "_runs"
    if any(o.startswith("drafter.drafter=") for o in args.overrides):
        sys.exit("set the speculating run's drafter with --drafter: an override would apply to both runs")
    from rlspec.config import load_config

    spec_drafter = args.drafter or load_config(args.config, []).drafter.drafter
    if spec_drafter == "none":
        sys.exit(f"{args.config} has drafter none: pass --drafter <name> to compare speculation against it")
    runs = {label: train(label, spec_drafter if label == "spec_on" else "none", args) for label in args.runs}
    rows = [result_row(label, s) for label, s in runs.items()]
    if len(rows) == 2:
        on, off = rows
        on["rollout_speedup"] = off["rollout_s"] / on["rollout_s"] if on["rollout_s"] else None
    curves = {label: {key: _series(s, key) for key in ("reward", "loss/value", "val/explained_variance", "val/mse",
                                                      "val/returns_var", "rollout/wall_s")}
              for label, s in runs.items()}
    for label, s in runs.items():  # the critic's out-of-sample error, pooled over 5-step windows
        curves[label]["pooled_error"] = _rolling_pooled_error(s)
    return {"rows": rows, "curves": curves,
            "columns": ["run", "wall_s", "rollout_s", "rollout_tok_s", "rollout_speedup", "reward_first",
                        f"reward_last{LAST}", "is_ratio_mean", f"value_error_last{WINDOW}"]}


def plot(report: dict, path: str) -> None:
    """Five panels: reward, value loss, the critic's explained variance, its pooled error over 5-step windows
    and rollout seconds per step, one line per run."""
    curves = report["curves"]
    panels = [("reward", "mean reward"), ("loss/value", "value loss"),
              ("val/explained_variance", "value explained variance"),
              ("pooled_error", "critic error / reward var (5 steps)"), ("rollout/wall_s", "rollout s")]
    with harness.png(path, 1, 5, figsize=(21, 3.5)) as (fig, axes):
        for ax, (key, label) in zip(axes, panels):
            for run_label, series in curves.items():
                if series[key]:
                    ax.plot(*zip(*series[key]), marker="o", markersize=3, label=run_label)
            ax.set_xlabel("PPO step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle("PPO on the embedded task: " + " vs ".join(curves) + " (same seed)")


