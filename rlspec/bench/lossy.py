"""Lossy acceleration on the embedded model: rollout speed vs lossless speculation and task accuracy vs
the target alone, across thresholds (a speed/accuracy curve). One process, one run per setting:

  target     no speculation, exact sampling: the accuracy reference
  lossless   the same drafter, exact verification: the speed reference (whole call and tail)
  rule@t     verification=judge, judge=rule, judge_threshold=t, for each --judges word (or --judge
             with each of --judge-thresholds)
  route@t    step_routing=arbitrage, route_threshold=t, for each --route-thresholds

All runs share the held-out prompts (rlspec.eval.heldout_math) and the sampling seed. Accuracy
differences are paired per sample against the target with a 95% interval, and each row says how
many samples would make that interval +-2 points (rlspec.eval.paired_difference); the verdict
names the fastest threshold that is >= 2x lossless speed and loses <= 2 points, with the noise
that claim carries. Writes JSON and a PNG (speed-up over lossless vs accuracy change).

    python -m rlspec.bench lossy --prompts 250 --samples 4
    python -m rlspec.bench lossy --temperature 0 --samples 1 --prompts 1000 --out bench_out/lossy_greedy.json

At temperature 0 (evaluation-style greedy decoding) lossless speculation is the target alone token for
token, so a lossy run differs from the target only on prompts where a judged or routed token changed
the text: the paired difference is exact up to those prompts and resolves 2 points with far fewer
prompts than sampling does (where two runs' samples are independent draws).
"""
from __future__ import annotations

import time

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, SMOKE_DTYPE, smoke_model

NAME = "lossy"
HELP = "lossy verification (judge rules, step routing): rollout speed vs lossless and accuracy vs the target alone"


def add_arguments(p) -> None:
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=250)
    p.add_argument("--prompt-seed", type=int, default=1234)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (a GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded at once: 8 is the embedded "
                    "GRPO rollout (2 prompts x 4 samples per step, configs/grpo_math.yaml)")
    p.add_argument("--warmup", type=int, default=8, help="prompts generated once before the timed call")
    p.add_argument("--drafter", default="suffix")
    p.add_argument("--selector", default="always", help="always: every step speculates in every spec run, so "
                    "lossless and lossy differ only in the verification rule (fixed: as a training run would)")
    p.add_argument("--judges", nargs="*", default=[], help="RULE@THRESHOLD words, e.g. relative@0.5 prob@0.01 "
                    "(instead of --judge and --judge-thresholds)")
    p.add_argument("--judge", default="prob")
    p.add_argument("--judge-thresholds", type=float, nargs="*", default=[0.3, 0.1, 0.03, 0.01])
    p.add_argument("--route-thresholds", type=float, nargs="*", default=[-0.5, -1.0, -2.0, -4.0])
    p.add_argument("--step-max-tokens", type=int, default=48)
    p.add_argument("--extra", nargs="*", default=[], help="more SpecConfig fields for every spec run, key=value")


def run(args) -> dict:
    if args.smoke:
        args.dtype, args.prompts, args.samples, args.max_new_tokens, args.warmup = SMOKE_DTYPE, 2, 2, 8, 0
        args.judge_thresholds, args.route_thresholds, args.judges = [0.1], [-1.0], []
        args.model = smoke_model(args.model, args.out)
    runs = run_all(args)
    rows = [{"setting": n, "accuracy": r["accuracy"], "diff_pts": 100 * r["vs_target"]["diff"],
             "ci95_pts": 100 * (r["vs_target"]["ci95"][1] - r["vs_target"]["diff"]), "tok_s": r["tokens_per_s"],
             "speedup": r["speedup"], "tail_speedup": r["tail_speedup"],
             "vs_target_speed": r["tokens_per_s"] / runs["target"]["tokens_per_s"],
             "lossy_share": r["stats"].get("rollout/lossy_token_share", 0.0),
             "n_for_2pts": r["vs_target"]["n_for_margin"]} for n, r in runs.items()]
    v = verdict(runs)
    print("verdict:", v)
    return {"rows": rows, "verdict": v,
            "runs": {n: {k: x for k, x in r.items() if k != "correct"} for n, r in runs.items()}}


def judges(args) -> list[tuple[str, float]]:
    """(rule, threshold) pairs: --judges RULE@T words, else --judge with each of --judge-thresholds."""
    if args.judges:
        pairs = [word.split("@", 1) for word in args.judges]
        if any(len(p) != 2 for p in pairs):
            raise SystemExit(f"--judges takes RULE@THRESHOLD words (e.g. relative@0.5 prob@0.01), got {args.judges}")
        return [(rule, float(t)) for rule, t in pairs]
    return [(args.judge, t) for t in args.judge_thresholds]


def settings(args) -> list[tuple[str, dict]]:
    base = {"drafter": args.drafter, "selector": args.selector, **dict(kv.split("=", 1) for kv in args.extra)}
    out = [("target", {}), ("lossless", base)]
    out += [(f"{rule}@{t:g}", {**base, "verification": "judge", "judge": rule, "judge_threshold": t,
                               "accept_off_policy": True}) for rule, t in judges(args)]
    out += [(f"route@{t:g}", {**base, "step_routing": "arbitrage", "route_threshold": t,
                              "step_max_tokens": args.step_max_tokens, "accept_off_policy": True})
            for t in args.route_thresholds]
    return out


def run_all(args) -> dict:
    from rlspec.eval import evaluate, heldout_math, paired_difference, parse_spec
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.types import SamplingParams
    from rlspec.trainers.data import prompt_token_ids

    convs, answers = heldout_math(args.prompts, seed=args.prompt_seed)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, n=args.samples,
                            seed=args.seed)
    runs = {}
    for name, fields in settings(args):
        spec = parse_spec([f"{k}={v}" for k, v in fields.items()])
        t0 = time.perf_counter()
        engine = RolloutEngine.from_pretrained(args.model, spec=spec, max_model_len=512, max_num_seqs=args.max_num_seqs,
                                              dtype=args.dtype)
        ids = prompt_token_ids(engine.tokenizer, convs)
        if args.warmup:  # the suffix index and the cost model see one call first, as in a training run
            evaluate(engine, ids[:args.warmup], answers[:args.warmup], params)
        r = evaluate(engine, ids, answers, params)
        engine.close()
        r["spec"], r["setup_s"] = fields, time.perf_counter() - t0 - r["wall_s"]
        runs[name] = r
        print(f"[bench lossy] {name}: accuracy {r['accuracy']:.3f}, {r['tokens_per_s']:.1f} tok/s "
              f"(tail {r['tail_tokens_per_s']:.1f}), lossy share {r['stats'].get('rollout/lossy_token_share', 0):.3f}",
              flush=True)
    ref, fast = runs["target"], runs["lossless"]
    for name, r in runs.items():
        r["vs_target"] = paired_difference(ref["correct"], r["correct"])
        r["speedup"] = r["tokens_per_s"] / fast["tokens_per_s"]
        r["tail_speedup"] = r["tail_tokens_per_s"] / fast["tail_tokens_per_s"] if fast["tail_tokens_per_s"] else 0.0
    return runs


def verdict(runs: dict, margin: float = 0.02) -> dict:
    """The fastest lossy setting >= 2x lossless (whole call) losing <= margin accuracy, and whether the
    sample size resolves `margin` (the 95% half-width of its paired difference <= margin)."""
    ok = [(r["speedup"], name) for name, r in runs.items()
          if name not in ("target", "lossless") and r["speedup"] >= 2 and r["vs_target"]["diff"] >= -margin]
    best = max(ok)[1] if ok else None
    out = {"aim": f">= 2x lossless speed at <= {margin * 100:g} points lost", "best": best}
    if best is not None:
        d = runs[best]["vs_target"]
        out.update(diff=d["diff"], ci95=d["ci95"], resolved=(d["ci95"][1] - d["ci95"][0]) / 2 <= margin,
                   n_for_margin=d["n_for_margin"], samples=runs[best]["samples"])
    return out


def plot(report: dict, path: str) -> None:
    """Speed-up over lossless (x) vs accuracy change with its 95% interval (y): one line per rule
    through its thresholds, whole call solid, tail dotted."""
    runs = report["runs"]
    lines: dict[str, list[str]] = {}
    for name in runs:
        if "@" in name:
            lines.setdefault(name.split("@")[0], []).append(name)
    with harness.png(path, figsize=(7, 4.5)) as (fig, ax):
        for i, (rule, names) in enumerate(lines.items()):
            for key, style in (("speedup", "-"), ("tail_speedup", ":")):
                names_k = [n for n in names if runs[n][key] > 0]  # a call without a tail has no tail speed
                if not names_k:
                    continue
                xs = [runs[n][key] for n in names_k]
                ys = [100 * runs[n]["vs_target"]["diff"] for n in names_k]
                err = [100 * (runs[n]["vs_target"]["ci95"][1] - runs[n]["vs_target"]["diff"]) for n in names_k]
                ax.errorbar(xs, ys, yerr=err, fmt=style, marker="os"[key != "speedup"], color=f"C{i}", capsize=3,
                            label=f"{rule} ({'whole call' if key == 'speedup' else 'tail'})")
                for n, x, y in zip(names_k, xs, ys):
                    ax.annotate(n.split("@")[1], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(-2, color="grey", lw=0.8, ls="--")
        ax.axvline(2, color="grey", lw=0.8, ls="--")
        ax.axvline(1, color="black", lw=0.5)
        ax.set_xlabel("rollout speed / lossless speculation")
        ax.set_ylabel("accuracy change vs target alone (points, 95% CI)")
        ax.set_title("lossy acceleration: speed vs accuracy (labels: thresholds)")
        ax.legend(fontsize=8)
