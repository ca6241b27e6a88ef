"""GRPO with a lossy mode vs lossless, same seeds: reward, lossy share and importance ratios side by side.

Runs `python -m rlspec.train config=grpo_math.yaml` once per arm in its own process (same seed, same
steps, same drafter): `lossless` with exact verification, `lossy` with the lossy overrides given.
From each run's summary.json it plots per step the reward, the lossy-token share, TRL's
importance-sampling ratio (mean and min: the behaviour logprobs reached it) and rollout tokens/s,
and writes a JSON with the curves and, per arm, the mean reward over the first and last third of
the steps and the rollout time. The lossy arm's rollout reward is scored on lossy text, so it mixes
"the rollouts got worse" with "the policy learned less": the answer to "was learning hurt?" is the
policy reward, each arm's final model (and the base model) sampled exactly (no speculation, T = 1)
on --eval-prompts training-task prompts, with its standard error.

    python scripts/bench_grpo_lossy.py --steps 30 --drafter suffix \\
        --lossy drafter.verification=judge drafter.judge_threshold=0.05 drafter.accept_off_policy=true
"""
from __future__ import annotations

from pathlib import Path

from common import math_task, parser, png, summary_of, table, train_run, write_json

CURVES = {"reward": "reward", "lossy share": "rollout/lossy_token_share",
          "TRL IS ratio mean": "sampling/importance_sampling_ratio/mean",
          "TRL IS ratio min": "sampling/importance_sampling_ratio/min", "rollout tokens/s": "rollout/tokens_per_s"}


def run(label: str, overrides: list[str], args) -> dict:
    out = Path(args.workdir) / label
    if args.reuse and (done := summary_of(out)) is not None:
        return done
    return train_run("bench_grpo_lossy", out, args.config, args.steps,
                     [f"drafter.drafter={args.drafter}", "grpo.save_steps=1000", *args.overrides, *overrides])


def policy_reward(model: str, args) -> dict:
    """Mean accuracy reward of `model` sampled alone (exact, T = 1) on the training task, with its
    binomial standard error."""
    import math

    from rlspec.eval import evaluate
    from rollout.engine import RolloutEngine
    from rollout.types import SamplingParams

    engine = RolloutEngine.from_pretrained(model, max_model_len=256, max_num_seqs=64)
    prompts, answers = math_task(engine.tokenizer, args.eval_prompts, seed=args.eval_seed)
    r = evaluate(engine, prompts, answers, SamplingParams(temperature=1.0, max_new_tokens=128, n=4, seed=0))
    engine.close()
    p = r["accuracy"]
    return {"reward": p, "se": math.sqrt(p * (1 - p) / r["samples"]), "samples": r["samples"]}


def thirds(values: list[float]) -> tuple[float, float]:
    k = max(1, len(values) // 3)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def plot(curves: dict, path: str) -> None:
    """One panel per curve of CURVES against the GRPO step, one line per arm."""
    with png(path, 1, len(CURVES), dpi=110, figsize=(4 * len(CURVES), 3.5)) as (fig, axes):
        for ax, title in zip(axes, CURVES):
            for i, (arm, c) in enumerate(curves.items()):
                pts = [(s, v) for s, v in zip(c["step"], c[title]) if v is not None]
                if pts:  # a fixed colour per arm: the lossless arm has no lossy-share points
                    ax.plot(*zip(*pts), marker=".", label=arm, color=f"C{i}")
            ax.set_title(title)
            ax.set_xlabel("GRPO step")
            ax.grid(alpha=0.3)
        axes[0].legend()


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--config", default="grpo_math.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--drafter", default="suffix")
    p.add_argument("--lossy", nargs="+", default=["drafter.verification=judge", "drafter.judge_threshold=0.05",
                                                  "drafter.accept_off_policy=true"])
    p.add_argument("--overrides", nargs="*", default=[], help="extra key=value for both runs")
    p.add_argument("--workdir", default="outputs/bench_grpo_lossy")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--eval-prompts", type=int, default=64, help="training-task prompts (x 4 samples) on which "
                   "each final policy is sampled alone; 0 skips")
    p.add_argument("--eval-seed", type=int, default=1, help="the data seed of those prompts (the run trains on seed 0)")
    p.add_argument("--out", default="bench_out/grpo_lossy.json")
    args = p.parse_args(argv)
    runs = {"lossless": run("lossless", [], args), "lossy": run("lossy", args.lossy, args)}
    curves, rows = {}, []
    for arm, s in runs.items():
        h = s["history"]
        curves[arm] = {"step": [e.get("step") for e in h], **{t: [e.get(k) for e in h] for t, k in CURVES.items()}}
        first, last = thirds([e["reward"] for e in h if e.get("reward") is not None])
        rows.append({"arm": arm, "reward_first_third": first, "reward_last_third": last,
                     "lossy_share_mean": _mean(curves[arm]["lossy share"]),
                     "is_ratio_min": min((v for v in curves[arm]["TRL IS ratio min"] if v is not None), default=None),
                     "rollout_s": sum(e.get("rollout/wall_s") or 0 for e in h), "wall_s": s["wall_s"]})
    if args.eval_prompts:
        models = {"base": runs["lossless"]["config"]["model"], **{arm: s["final_model"] for arm, s in runs.items()}}
        policy = {arm: policy_reward(m, args) for arm, m in models.items()}
        for row in rows:
            row["policy_reward"], row["policy_reward_se"] = policy[row["arm"]]["reward"], policy[row["arm"]]["se"]
        rows.append({"arm": "base", "policy_reward": policy["base"]["reward"], "policy_reward_se": policy["base"]["se"]})
    print(table(rows, list(rows[0])))
    write_json(args.out, {"config": vars(args), "results": rows, "curves": curves})
    plot(curves, args.out.replace(".json", ".png"))


def _mean(values):
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else 0.0


if __name__ == "__main__":
    main()
