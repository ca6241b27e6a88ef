"""GRPO with a lossy mode vs lossless (`python -m rlspec.bench grpo --lossy ...`): same seed, steps and drafter.

Per step the reward, the lossy-token share, TRL's importance-sampling ratio (mean and min: the behaviour
logprobs reached it) and rollout tokens/s; per arm the mean reward over the first and last third of the steps.
The lossy arm's rollout reward is scored on lossy text, so it mixes "the rollouts got worse" with "the policy
learned less": the answer to "was learning hurt?" is the policy reward, each arm's final model (and the base
model) sampled exactly (no speculation, T = 1) on --eval-prompts training-task prompts, with its standard error.
"""
from __future__ import annotations

import math

from rlspec.bench import harness
from rlspec.bench.common import math_task

CURVES = {"reward": "reward", "lossy share": "rollout/lossy_token_share",
          "TRL IS ratio mean": "sampling/importance_sampling_ratio/mean",
          "TRL IS ratio min": "sampling/importance_sampling_ratio/min", "rollout tokens/s": "rollout/tokens_per_s"}


def policy_reward(model: str, args) -> dict:
    """Mean accuracy reward of `model` sampled alone (exact, T = 1) on the training task, with its binomial
    standard error."""
    from rlspec.eval import evaluate
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.types import SamplingParams

    engine = RolloutEngine.from_pretrained(model, max_model_len=256, max_num_seqs=64,
                                           dtype="float32" if args.smoke else "bfloat16")
    prompts, answers = math_task(engine.tokenizer, args.eval_prompts, seed=args.eval_seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=8 if args.smoke else 128, n=4, seed=0)
    r = evaluate(engine, prompts, answers, params)
    engine.close()
    p = r["accuracy"]
    return {"reward": p, "se": math.sqrt(p * (1 - p) / r["samples"]), "samples": r["samples"]}


def thirds(values: list[float]) -> tuple[float, float]:
    k = max(1, len(values) // 3)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def _mean(values):
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else 0.0


def run_lossy(args, train) -> dict:
    drafter = f"drafter.drafter={args.drafters[0]}"
    runs = {"lossless": train("lossless", [drafter], args), "lossy": train("lossy", [drafter, *args.lossy], args)}
    curves, rows = {}, []
    for arm, s in runs.items():
        h = s["history"]
        curves[arm] = {"step": [e.get("step") for e in h], **{t: [e.get(k) for e in h] for t, k in CURVES.items()}}
        first, last = thirds([e["reward"] for e in h if e.get("reward") is not None] or [0.0])
        rows.append({"arm": arm, "reward_first_third": first, "reward_last_third": last,
                     "lossy_share_mean": _mean(curves[arm]["lossy share"]),
                     "is_ratio_min": min((v for v in curves[arm]["TRL IS ratio min"] if v is not None), default=None),
                     "rollout_s": sum(e.get("rollout/wall_s") or 0 for e in h), "wall_s": s["wall_s"]})
    if args.eval_prompts:
        models = {"base": runs["lossless"]["config"]["model"], **{arm: s["final_model"] for arm, s in runs.items()}}
        policy = {arm: policy_reward(m, args) for arm, m in models.items()}
        for row in rows:
            row["policy_reward"], row["policy_reward_se"] = policy[row["arm"]]["reward"], policy[row["arm"]]["se"]
        base = policy["base"]
        rows.append({"arm": "base", "policy_reward": base["reward"], "policy_reward_se": base["se"]})
    return {"part": "lossy", "rows": rows, "curves": curves,
            "columns": ["arm", "reward_first_third", "reward_last_third", "lossy_share_mean", "is_ratio_min",
                        "rollout_s", "wall_s", "policy_reward", "policy_reward_se"]}


def plot(report: dict, path: str) -> None:
    """One panel per curve of CURVES against the GRPO step, one line per arm."""
    curves = report["curves"]
    with harness.png(path, 1, len(CURVES), dpi=110, figsize=(4 * len(CURVES), 3.5)) as (fig, axes):
        for ax, title in zip(axes, CURVES):
            for i, (arm, c) in enumerate(curves.items()):
                pts = [(s, v) for s, v in zip(c["step"], c[title]) if v is not None]
                if pts:  # a fixed colour per arm: the lossless arm has no lossy-share points
                    ax.plot(*zip(*pts), marker=".", label=arm, color=f"C{i}")
            ax.set_title(title)
            ax.set_xlabel("GRPO step")
            ax.grid(alpha=0.3)
        axes[0].legend()
