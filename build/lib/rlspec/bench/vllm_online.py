"""GRPO on the vLLM backend with the learned drafter trained online (`python -m rlspec.bench vllm --part online`).

Runs `python -m rlspec.train config=grpo_math.yaml rollout.backend=vllm drafter.drafter=eagle3` for --steps steps
(in a process of its own) and reads its summary.json: per step vLLM's accepted tokens per verify
(rollout/accept_len, from vLLM's counters), the drafter versions pushed into vLLM so far, and TRL's
importance-sampling ratio (1 when vLLM sampled what the policy gives). The drafter starts cold (no warm start, no
drafter_path) so that what it gains is learned from the trainer's forward passes during the run, and trains online
(on CPU too, where `auto` would keep it off); vLLM drafts a chain of 3 at every step (selector always) so that every
step measures the acceptance of the drafter version it ran with.
"""
from __future__ import annotations

from pathlib import Path
from statistics import mean

from rlspec.bench import harness
from rlspec.bench.common import summary_of, train_run


def run_online(args) -> dict:
    out = Path(args.workdir)
    s = summary_of(out) if args.reuse else None
    if s is None or s.get("status") != "finished":
        s = train_run("bench vllm", out, args.config, args.steps,
                      ["rollout.backend=vllm", "drafter.drafter=eagle3", "drafter.warm_start_s=0",
                       "drafter.online_training=true", "drafter.selector=always", "drafter.num_draft_tokens=3",
                       "grpo.save_steps=1000", *args.overrides])
    steps = [{"step": i + 1, "accept_len": h.get("rollout/accept_len"), "pushes": h.get("vllm/drafter_pushes"),
              "drafter_version": h.get("drafter/version"), "is_ratio": h.get("sampling/importance_sampling_ratio/mean"),
              "logp_diff": h.get("sampling/sampling_logp_difference/mean")} for i, h in enumerate(s["history"])]
    acc = [r["accept_len"] for r in steps if r["accept_len"] is not None]
    ratios = [r["is_ratio"] for r in steps if r["is_ratio"] is not None]
    w = args.window
    result = {"steps": len(steps), "accept_first": mean(acc[:w]) if acc else None,
              "accept_last": mean(acc[-w:]) if acc else None,
              # every push moves the version vLLM drafts with (drafter/version), so pushes = its rises
              "drafter_pushes": sum(1 for a, b in zip(steps, steps[1:])
                                    if (b["drafter_version"] or 0) > (a["drafter_version"] or 0)),
              "is_ratio_mean": mean(ratios) if ratios else None,
              "is_ratio_range": [min(ratios), max(ratios)] if ratios else None,
              "wall_s": s.get("wall_s"), "status": s.get("status")}
    print(harness.table(steps, ["step", "accept_len", "pushes", "drafter_version", "is_ratio", "logp_diff"]))
    return {"part": "online", "result": result, "per_step": steps, "rows": [result],
            "columns": ["steps", "accept_first", "accept_last", "drafter_pushes", "is_ratio_mean"]}


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib  # noqa: F401  (not in .venv-vllm: rerun with --reuse from .venv for the picture)
    except ModuleNotFoundError:
        print("no matplotlib here: `.venv/bin/python -m rlspec.bench vllm --part online --reuse` draws the PNG")
        return
    harness.line_plot({"vLLM accepted tokens per verify": [(r["step"], r["accept_len"]) for r in report["per_step"]
                                                           if r["accept_len"] is not None]},
                      "GRPO step", "accepted tokens / verify", "vLLM backend, drafter trained online", path)
