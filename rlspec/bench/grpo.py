"""End-to-end GRPO: `python -m rlspec.train config=grpo_math.yaml` once per arm (same seed, same steps, a process
each so W&B and threads start clean), compared from each run's summary.json.

  drafters  (default) one arm per --drafters entry: wall time, rollout time, tokens/s, reward, and per step the
            accepted length (a learned drafter trains online during the run). A learned drafter is warmed up
            before step 1 and cached by the target's weights: naming it twice (`--drafters none auto auto`)
            measures the run that pays the warm-up and one that loads it ("auto#2").
  --lossy   lossless vs lossy verification with the same drafter (rlspec/bench/grpo_lossy.py): reward, lossy
            share and importance ratios per step, and the final policies sampled exactly on held-out prompts.

    python -m rlspec.bench grpo --steps 30 --drafters none auto auto
    python -m rlspec.bench grpo --steps 30 --drafters suffix --lossy drafter.verification=judge \\
        drafter.judge_threshold=0.05 drafter.accept_off_policy=true
"""
from __future__ import annotations

from pathlib import Path

from rlspec.bench import harness
from rlspec.bench.common import rollout_seconds, smoke_train, summary_of, train_run

NAME = "grpo"
HELP = "end-to-end GRPO runs per drafter (time, reward, acceptance per step); --lossy: lossy vs lossless training"


def add_arguments(p) -> None:
    p.add_argument("--config", default="grpo_math.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--drafters", nargs="+", default=["none", "suffix", "eagle3"])
    p.add_argument("--lossy", nargs="*", default=None, help="lossy overrides: compare lossless vs lossy training "
                   "(the first --drafters entry drafts for both)")
    p.add_argument("--eval-prompts", type=int, default=64, help="--lossy: held-out prompts (x4 samples) each final "
                   "policy is sampled on alone; 0 skips")
    p.add_argument("--eval-seed", type=int, default=1, help="--lossy: data seed of those prompts")
    p.add_argument("--workdir", default="outputs/bench_grpo")
    p.add_argument("--overrides", nargs="*", default=[], help="extra key=value for every run")
    p.add_argument("--reuse", action="store_true", help="keep runs that already finished in --workdir")


def labels(drafters: list[str]) -> list[str]:
    """A drafter named again gets '#<n>' (its n-th run)."""
    return [d if drafters[:i].count(d) == 0 else f"{d}#{drafters[:i].count(d) + 1}" for i, d in enumerate(drafters)]


def train(label: str, overrides: list[str], args) -> dict:
    """The summary of the run `label` in --workdir: trained now, or with --reuse the one that finished before."""
    out = Path(args.workdir) / label.replace("#", "_")
    done = summary_of(out) if args.reuse else None
    if done is not None and done.get("status") == "finished":
        print(f"[bench grpo] reusing the finished run in {out}", flush=True)
        return done
    smoke = smoke_train(args.workdir) if args.smoke else []
    return train_run("bench grpo", out, args.config, args.steps, ["grpo.save_steps=1000", *smoke, *args.overrides,
                                                                  *overrides], in_process=args.smoke)


def run(args) -> dict:
    if args.smoke:
        args.steps, args.drafters, args.eval_prompts = 1, args.drafters[:1] + ["suffix"], 2
        args.workdir = str(Path(args.out).with_suffix("")) + "_runs"
    if args.lossy is not None:
        from rlspec.bench.grpo_lossy import run_lossy

        return run_lossy(args, train)
    runs = {label: train(label, [f"drafter.drafter={label.split('#')[0]}"], args) for label in labels(args.drafters)}
    rows = [_row(label, s) for label, s in runs.items()]
    base = rows[0]
    for r in rows:
        r["wall_speedup"] = base["wall_s"] / r["wall_s"]
        r["wall_speedup_without_warm_up"] = base["wall_s"] / (r["wall_s"] - r["warm_start_s"])
        r["rollout_speedup"] = base["rollout_s"] / r["rollout_s"] if r["rollout_s"] else None
    curves = {d: [(h.get("step"), h.get("rollout/accept_len"), h.get("drafter/version"), h.get("drafter/accept_len"))
                  for h in s["history"]] for d, s in runs.items()}
    return {"part": "drafters", "rows": rows, "accept_len_per_step": curves}


def _row(label: str, s: dict) -> dict:
    acc = [h.get("rollout/accept_len") for h in s["history"] if h.get("rollout/accept_len") is not None]
    warm = s.get("drafter_warm_start") or {}
    return {"drafter": label, "wall_s": s["wall_s"], "warm_start_s": warm.get("seconds", 0.0),
            "warm_cached": warm.get("cached"), "rollout_s": rollout_seconds(s), "tokens_per_s": s["tokens_per_s"],
            "reward_first": s["reward_first"], "reward_last": s["reward_last"],
            "accept_len_first": acc[0] if acc else None, "accept_len_last": acc[-1] if acc else None,
            "accept_len_mean": sum(acc) / len(acc) if acc else None}


def plot(report: dict, path: str) -> None:
    if report["part"] == "lossy":
        from rlspec.bench.grpo_lossy import plot as lossy_plot

        return lossy_plot(report, path)
    curves = report["accept_len_per_step"]
    series = {d: [(s, a) for s, a, *_ in pts if a is not None] for d, pts in curves.items()}
    for d, pts in curves.items():  # the learned drafter alone, where it ran
        own = [(s, a) for s, _, _, a in pts if a is not None]
        if own:
            series[f"{d}: eagle3 steps only"] = own
    harness.line_plot(series, "GRPO step", "accepted tokens per verify", "drafter acceptance while the policy trains",
                      path)
