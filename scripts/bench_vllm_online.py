"""GRPO on the vLLM backend with the learned drafter trained online: does vLLM's acceptance rise?

Runs `python -m rlspec.train config=grpo_math.yaml rollout.backend=vllm drafter.drafter=eagle3` for --steps
steps (in a process of its own) and reads its summary.json: per step vLLM's accepted tokens per verify
(rollout/accept_len, from vLLM's counters), the drafter versions pushed into vLLM so far (vllm/drafter_pushes), and
TRL's importance-sampling ratio (sampling/importance_sampling_ratio/mean: 1 when vLLM sampled what the
policy gives). The drafter starts cold (no warm start, no drafter_path) so that what it gains is learned
from the trainer's forward passes during the run, and trains online (on CPU too, where `auto` would keep
it off); vLLM drafts a chain of 3 at every step (selector always) so that every step measures the
acceptance of the drafter version it ran with. Run inside .venv-vllm:

    .venv-vllm/bin/python scripts/bench_vllm_online.py --steps 30 --out bench_out/vllm_online.json
"""
from __future__ import annotations

from pathlib import Path
from statistics import mean

from common import line_plot, parser, summary_of, table, train_run, write_json


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--config", default="grpo_math.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--window", type=int, default=5, help="steps compared at the start and the end")
    p.add_argument("--workdir", default="outputs/bench_vllm_online")
    p.add_argument("--overrides", nargs="*", default=[], help="extra key=value for the run")
    p.add_argument("--reuse", action="store_true", help="read a run that already finished in --workdir")
    p.add_argument("--out", default="bench_out/vllm_online.json")
    args = p.parse_args(argv)
    out = Path(args.workdir)
    s = summary_of(out) if args.reuse else None
    if s is None or s.get("status") != "finished":
        s = train_run("bench_vllm_online", out, args.config, args.steps,
                      ["rollout.backend=vllm", "drafter.drafter=eagle3", "drafter.warm_start_s=0",
                       "drafter.online_training=true", "drafter.selector=always", "drafter.num_draft_tokens=3",
                       "grpo.save_steps=1000", *args.overrides])
    hist = s["history"]
    steps = [{"step": i + 1, "accept_len": h.get("rollout/accept_len"), "pushes": h.get("vllm/drafter_pushes"),
              "drafter_version": h.get("drafter/version"), "is_ratio": h.get("sampling/importance_sampling_ratio/mean"),
              "logp_diff": h.get("sampling/sampling_logp_difference/mean")} for i, h in enumerate(hist)]
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
    print(table(steps, ["step", "accept_len", "pushes", "drafter_version", "is_ratio", "logp_diff"]))
    print(table([result], ["steps", "accept_first", "accept_last", "drafter_pushes", "is_ratio_mean"]))
    write_json(args.out, {"args": vars(args), "result": result, "per_step": steps})
    try:
        import matplotlib  # noqa: F401  (not in .venv-vllm: re-run with --reuse from .venv for the picture)
    except ModuleNotFoundError:
        print("no matplotlib here: `.venv/bin/python scripts/bench_vllm_online.py --reuse` draws the PNG")
        return
    line_plot({"vLLM accepted tokens per verify": [(r["step"], r["accept_len"]) for r in steps
                                                   if r["accept_len"] is not None]},
              "GRPO step", "accepted tokens / verify", "vLLM backend, drafter trained online",
              str(Path(args.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
