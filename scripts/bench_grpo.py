"""End-to-end GRPO with and without speculation: total run time and the drafter's acceptance per step.

Runs `python -m rlspec.train config=grpo_math.yaml` once per drafter setting (same seed, same
steps, separate processes so W&B and threads start clean), then compares from each run's
summary.json: wall time, rollout time, tokens/s, and per step the accepted length (for eagle3 the
drafter is trained online during the run: its acceptance should hold or rise as the policy moves).
Writes JSON and a PNG. A learned drafter is warmed up before step 1 and cached by the target's
weights (drafter.warm_start_s): naming a drafter twice (`--drafters none auto auto`) measures the
first run, which pays the warm-up, and a second that loads it from the cache ("auto#2").

    python scripts/bench_grpo.py --steps 30 --drafters none auto auto --out bench_out/grpo.json
"""
from __future__ import annotations

from pathlib import Path

from common import line_plot, parser, rollout_seconds, summary_of, table, train_run, write_json


def run(label: str, args) -> dict:
    """The summary of the run `label` (a drafter, "#2" for its second run) in --workdir: trained now, or with
    --reuse the one that finished there before."""
    drafter = label.split("#")[0]
    out = Path(args.workdir) / label.replace("#", "_")
    done = summary_of(out) if args.reuse else None
    if done is not None and done["status"] == "finished":
        print(f"[bench_grpo] reusing the finished run in {out}", flush=True)
        return done
    return train_run("bench_grpo", out, args.config, args.steps,
                     [f"drafter.drafter={drafter}", "grpo.save_steps=1000", *args.overrides])


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--config", default="grpo_math.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--drafters", nargs="+", default=["none", "suffix", "eagle3"])
    p.add_argument("--workdir", default="outputs/bench_grpo")
    p.add_argument("--overrides", nargs="*", default=[], help="extra key=value for every run")
    p.add_argument("--reuse", action="store_true", help="keep runs that already finished in --workdir")
    p.add_argument("--out", default="bench_out/grpo.json")
    args = p.parse_args(argv)
    labels = [d if args.drafters[:i].count(d) == 0 else f"{d}#{args.drafters[:i].count(d) + 1}"
              for i, d in enumerate(args.drafters)]
    runs = {label: run(label, args) for label in labels}
    rows = []
    for d, s in runs.items():
        rollout_s = rollout_seconds(s)
        acc = [h.get("rollout/accept_len") for h in s["history"] if h.get("rollout/accept_len") is not None]
        warm = s.get("drafter_warm_start") or {}
        rows.append({"drafter": d, "wall_s": s["wall_s"], "warm_start_s": warm.get("seconds", 0.0),
                     "warm_cached": warm.get("cached"), "rollout_s": rollout_s, "tokens_per_s": s["tokens_per_s"],
                     "reward_first": s["reward_first"], "reward_last": s["reward_last"],
                     "accept_len_first": acc[0] if acc else None, "accept_len_last": acc[-1] if acc else None,
                     "accept_len_mean": sum(acc) / len(acc) if acc else None})
    base = rows[0]
    for r in rows:
        r["wall_speedup"] = base["wall_s"] / r["wall_s"]
        r["wall_speedup_without_warm_up"] = base["wall_s"] / (r["wall_s"] - r["warm_start_s"])
        r["rollout_speedup"] = base["rollout_s"] / r["rollout_s"] if r["rollout_s"] else None
    print(table(rows, list(rows[0])))
    curves = {d: [(h.get("step"), h.get("rollout/accept_len"), h.get("drafter/version"), h.get("drafter/accept_len"))
                  for h in s["history"]] for d, s in runs.items()}
    write_json(args.out, {"config": vars(args), "results": rows, "accept_len_per_step": curves})
    plot(curves, args.out.replace(".json", ".png"))


def plot(curves, path):
    series = {d: [(s, a) for s, a, *_ in pts if a is not None] for d, pts in curves.items()}
    for d, pts in curves.items():  # the learned drafter alone, where it ran
        own = [(s, a) for s, _, _, a in pts if a is not None]
        if own:
            series[f"{d}: eagle3 steps only"] = own
    line_plot(series, "GRPO step", "accepted tokens per verify", "drafter acceptance while the policy trains", path)


if __name__ == "__main__":
    main()
