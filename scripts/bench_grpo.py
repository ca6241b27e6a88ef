"""End-to-end GRPO with and without speculation: total run time and the drafter's acceptance per step.

Runs `python -m rlspec.train config=grpo_math.yaml` once per drafter setting (same seed, same
steps, separate processes so W&B and threads start clean), then compares from each run's
summary.json: wall time, rollout time, tokens/s, and per step the accepted length (for eagle3 the
drafter is trained online during the run: its acceptance should hold or rise as the policy moves).
Writes JSON and a PNG.

    python scripts/bench_grpo.py --steps 12 --drafters none suffix eagle3 --out bench_out/grpo.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import line_plot, table, write_json

ROOT = Path(__file__).resolve().parents[1]


def run(drafter: str, args) -> dict:
    out = Path(args.workdir) / drafter
    cmd = [sys.executable, "-m", "rlspec.train", f"config={args.config}", f"grpo.max_steps={args.steps}",
           f"output_dir={out}", f"drafter.drafter={drafter}", "grpo.save_steps=1000", *args.overrides]
    print("[bench_grpo]", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads((out / "summary.json").read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="grpo_math.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--drafters", nargs="+", default=["none", "suffix", "eagle3"])
    p.add_argument("--workdir", default="outputs/bench_grpo")
    p.add_argument("--overrides", nargs="*", default=[], help="extra key=value for every run")
    p.add_argument("--out", default="bench_out/grpo.json")
    args = p.parse_args(argv)
    runs = {d: run(d, args) for d in args.drafters}
    rows = []
    for d, s in runs.items():
        rollout_s = sum(r.get("rollout_s") or 0 for r in s["rows"])
        acc = [h.get("rollout/accept_len") for h in s["history"] if h.get("rollout/accept_len") is not None]
        rows.append({"drafter": d, "wall_s": s["wall_s"], "rollout_s": rollout_s, "tokens_per_s": s["tokens_per_s"],
                     "reward_first": s["reward_first"], "reward_last": s["reward_last"],
                     "accept_len_first": acc[0] if acc else None, "accept_len_last": acc[-1] if acc else None})
    base = rows[0]
    for r in rows:
        r["wall_speedup"] = base["wall_s"] / r["wall_s"]
        r["rollout_speedup"] = base["rollout_s"] / r["rollout_s"] if r["rollout_s"] else None
    print(table(rows, list(rows[0])))
    curves = {d: [(h.get("step"), h.get("rollout/accept_len"), h.get("drafter/version")) for h in s["history"]]
              for d, s in runs.items()}
    write_json(args.out, {"config": vars(args), "results": rows, "accept_len_per_step": curves})
    plot(curves, args.out.replace(".json", ".png"))


def plot(curves, path):
    series = {d: [(s, a) for s, a, _ in pts if a is not None] for d, pts in curves.items()}
    line_plot(series, "GRPO step", "accepted tokens per verify", "drafter acceptance while the policy trains", path)


if __name__ == "__main__":
    main()
