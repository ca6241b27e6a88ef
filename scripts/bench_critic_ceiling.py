"""How much of the outcome reward can PPO's critic predict on the embedded task? The ceiling, offline.

PPO's value model regresses V(s_t) on the return; with `value_lam: 1.0` (configs/ppo_math.yaml) the
target at every completion token is the outcome reward. This script samples rollouts of a policy on
the training task, reads the policy's last hidden state at every completion token (the value head's
input: trainers/ppo_model.py, `completion_hidden`) and fits the best linear head offline: ridge
regression in closed form, its penalty picked by cross-validation, prompts held out (a critic is
always asked about prompts it has not trained on). The held-out error over the return variance,
`mse / var`, is `1 - explained variance` and what bench_ppo's pooled `val/mse / val/returns_var`
can at best reach with `value_model: head` on frozen features (far more data and updates than a
30-step run gets: here every token of every rollout, fitted to convergence).

Feature sets compared (each row: pooled over all tokens, and by where the token sits in its
completion: first quarter, last quarter, last token):
  hidden          the value head's input
  position        t and log(1 + t) only: "long completions are truncated and wrong"
  hidden+position
  prompt oracle   each rollout's siblings' mean reward (same prompt, leave-one-out): a critic that
                  knows each prompt's difficulty as well as its other samples show it

    python scripts/bench_critic_ceiling.py --prompts 384 --out bench_out/critic_ceiling_1536.json
    python scripts/bench_critic_ceiling.py --ops + '*' --max-operand 20 --out bench_out/critic_ceiling_mixed.json

The second asks whether difficulty that shows in the prompt (sums and products up to 20) gives a
critic more to learn; measured, it did not (0.99: bench_out/RESULTS.md, session 8).
"""
from __future__ import annotations

import math

from common import math_task, parser, table, write_json

RIDGE = (1e-1, 1.0, 10.0, 1e2, 1e3, 1e4, 1e5)  # the largest ~ predicting the mean
BUCKETS = ("all", "first quarter", "last quarter", "last token")


def rollouts(args) -> tuple[list[list[int]], list[list[int]], list[float], list[int]]:
    """(prompt ids, completion ids, reward, prompt index) per sample, from the engine at the run's settings."""
    from rollout.engine import RolloutEngine
    from rollout.types import SamplingParams
    from trainers.rewards import accuracy_reward

    engine = RolloutEngine.from_pretrained(args.policy, dtype="float32", max_model_len=256, max_num_seqs=32)
    # the training set's rows, past the ones a 30-step run (2 prompts a step) has seen first
    prompts, answers = math_task(engine.tokenizer, args.prompts + 64, 0, args.max_operand, tuple(args.ops))
    prompts, answers = prompts[64:], answers[64:]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.samples, seed=args.seed)
    results = engine.generate(prompts, params)
    texts = [engine.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in results]
    rewards = [float(x or 0.0) for x in accuracy_reward(texts, answer=[answers[r.prompt_index] for r in results])]
    engine.close()
    return ([prompts[r.prompt_index] for r in results], [list(r.completion_ids) for r in results], rewards,
            [r.prompt_index for r in results])


def token_table(args, prompts, completions, rewards, groups):
    """Per completion token: hidden state (value-head input), position t, bucket flags, return, group."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainers.ppo_model import backbone_of, completion_hidden

    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval()
    feats, pos, buckets, y, g = [], [], [], [], []
    with torch.no_grad():
        for p, c, r, grp in zip(prompts, completions, rewards, groups):
            if not c:
                continue
            ids = torch.tensor([p + c])
            h = completion_hidden(backbone_of(model), ids, torch.ones_like(ids), len(c))[0]
            n = len(c)
            feats.append(h)
            pos += list(range(n))
            buckets += [(t < n / 4, t >= 3 * n / 4, t == n - 1) for t in range(n)]
            y += [r] * n
            g += [grp] * n
    return torch.cat(feats), torch.tensor(pos, dtype=torch.float32), torch.tensor(buckets), torch.tensor(y), torch.tensor(g)


def ridge_cv(x, y, groups, folds: int) -> tuple:
    """Held-out predictions of ridge regression (standardised features, intercept), the penalty chosen
    by the same grouped folds (so, if anything, the error flatters the critic): (predictions, penalty)."""
    import torch

    fold_of = groups % folds
    best = None
    for lam in RIDGE:
        pred = torch.empty_like(y)
        for k in range(folds):
            tr, te = fold_of != k, fold_of == k
            mu, sd = x[tr].mean(0), x[tr].std(0).clamp_min(1e-6)

            def design(rows):  # standardised by the training fold, plus an intercept column
                return torch.cat([(x[rows] - mu) / sd, torch.ones(int(rows.sum()), 1, dtype=x.dtype)], 1).double()

            xt = design(tr)
            reg = lam * torch.eye(xt.shape[1], dtype=torch.float64)
            reg[-1, -1] = 0.0  # no penalty on the intercept
            w = torch.linalg.solve(xt.T @ xt + reg, xt.T @ y[tr].double())
            pred[te] = (design(te) @ w).float()
        err = float(((pred - y) ** 2).mean())
        if best is None or err < best[0]:
            best = (err, pred, lam)
    return best[1], best[2]


def oracle(rewards: list[float], groups: list[int]) -> list[float]:
    """Per rollout: the mean reward of the other rollouts of its prompt (leave-one-out; its own reward
    where it has no sibling)."""
    sums, counts = {}, {}
    for grp, r in zip(groups, rewards):
        sums[grp] = sums.get(grp, 0.0) + r
        counts[grp] = counts.get(grp, 0) + 1
    return [(sums[grp] - r) / (counts[grp] - 1) if counts[grp] > 1 else r for grp, r in zip(groups, rewards)]


def scores(pred, y, buckets) -> dict:
    """mse / var per bucket (var: of the returns in that bucket, around their own mean)."""
    out = {}
    masks = {"all": None, "first quarter": buckets[:, 0], "last quarter": buckets[:, 1], "last token": buckets[:, 2]}
    for name, m in masks.items():
        p, t = (pred, y) if m is None else (pred[m], y[m])
        var = float(t.var(unbiased=False))
        out[name] = float(((p - t) ** 2).mean()) / var if var > 0 else math.nan
    return out


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--policy", default="smollm2-135m-instruct", help="a model directory or embedded name")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ops", nargs="+", default=["+"], help="the task's operations (configs/ppo_math.yaml: +)")
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/critic_ceiling.json")
    args = ap.parse_args(argv)
    import torch

    from rollout.runtime.model.fetch import fetch_model  # embedded names -> the cached directory

    args.policy = fetch_model(args.policy)
    prompts, completions, rewards, groups = rollouts(args)
    x, t, buckets, y, g = token_table(args, prompts, completions, rewards, groups)
    position = torch.stack([t, torch.log1p(t)], 1)
    rows, penalties = [], {}
    for name, feats in (("hidden", x), ("position", position), ("hidden+position", torch.cat([x, position], 1))):
        pred, penalties[name] = ridge_cv(x=feats, y=y, groups=g, folds=args.folds)
        rows.append({"features": name, **scores(pred, y, buckets)})
    per_token = torch.repeat_interleave(torch.tensor(oracle(rewards, groups)),
                                        torch.tensor([len(c) for c in completions]))
    rows.append({"features": "prompt oracle", **scores(per_token, y, buckets)})
    summary = {"samples": len(rewards), "tokens": len(y), "mean_reward": sum(rewards) / len(rewards),
               "reward_var": float(torch.tensor(rewards).var(unbiased=False)),
               "mean_completion_tokens": len(y) / len(rewards), "ridge_penalty": penalties}
    print(table(rows, ["features", *BUCKETS]))
    print(summary)
    write_json(args.out, {"args": vars(args), "summary": summary, "mse_over_var": rows,
                          "note": "held-out (grouped by prompt) ridge fits; 1 = no better than the mean, 0 = perfect"})
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
