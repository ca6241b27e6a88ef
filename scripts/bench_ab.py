"""Before/after in one sitting: `bench_rollout.py` of another checkout against this one, alternated.

Absolute speed on shared machines drifts 20-30% between runs, so a regression check compares the
engine/transformers ratio of two checkouts measured back to back, several times, alternating:

    git worktree add /tmp/rlspec-old <commit>
    python scripts/bench_ab.py --old /tmp/rlspec-old --reps 2 --out bench_out/cpu_ab.json

Prints, per batch size, each run's engine/HF ratio and the medians; writes them to JSON.

The ratio's two halves are timed minutes apart, and on a shared 2-core machine the speed itself
drifts up to 1.5x within minutes (transformers at batch 8 measured 98-140 tok/s in one sitting), so
`--direct` also times the two engines against each other: the same call (T=1, EOS ignored) in a
fresh process per checkout, alternated, best of --direct-reps calls each; new/old is its speed ratio.
`--longtail` instead times the engine on the GRPO-shaped long-tail workload of `bench_rollout.py`
(ragged lengths, natural EOS, rows refilled as samples finish) in each checkout, alternated.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, parser, table, write_json


def rollout_report(tree: Path, flags: list[str]) -> dict:
    """The JSON report of `tree`'s own scripts/bench_rollout.py run with `flags`, in a fresh process
    importing `tree`'s code."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, str(tree / "scripts" / "bench_rollout.py"), *flags, "--out", str(out)]
        subprocess.run(cmd, cwd=tree, check=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin",
                                                         "HF_HUB_OFFLINE": "1"})
        return json.loads(out.read_text())


def alternated(reps: int, old: Path, measure, say) -> dict[str, list]:
    """measure(tree) of the old checkout, then of this one, `reps` times over; say(name, result) after each."""
    runs: dict[str, list] = {"old": [], "new": []}
    for _ in range(reps):
        for name, tree in (("old", old), ("new", ROOT)):
            runs[name].append(measure(tree))
            say(name, runs[name][-1])
    return runs


def run_once(tree: Path, batch_sizes: list[int], tokens: int) -> dict[str, float]:
    """The engine/HF tokens/s ratio per batch size of `tree`'s bench_rollout.py (fixed workload)."""
    report = rollout_report(tree, ["--batch-sizes", *map(str, batch_sizes), "--max-new-tokens", str(tokens)])
    return {str(k): float(v) for k, v in report["ratio"].items()}


ENGINE_TIME = """
import sys, time
sys.path.insert(0, sys.argv[1])
from rollout.engine import RolloutEngine
from rollout.types import SamplingParams
batch, tokens, reps = map(int, sys.argv[2:5])
eng = RolloutEngine.from_pretrained("smollm2-135m-instruct", dtype="bfloat16", max_model_len=512)
prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10 + i] * 5 for i in range(batch)]
eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=0))
best = float("inf")
for _ in range(reps):
    t = time.perf_counter()
    eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True, seed=0))
    best = min(best, time.perf_counter() - t)
print(batch * tokens / best)
"""


def longtail_once(tree: Path, args) -> dict[str, float]:
    """The engine's tok/s (whole call, and its full and tail phases) on the long-tail workload."""
    report = rollout_report(tree, ["--workload", "longtail", "--configs", "engine", "--prompts", str(args.prompts),
                                   "--group", str(args.group), "--reps", "1", "--max-new-tokens",
                                   str(args.max_new_tokens)])
    r = next(r for r in report["results"] if r["config"] == "engine")
    return {k: float(r[k]) for k in ("tokens_per_s", "full_tokens_per_s", "tail_tokens_per_s")}


def longtail(args, old: Path) -> dict:
    runs = alternated(args.reps, old, lambda tree: longtail_once(tree, args),
                      lambda name, r: print(f"longtail {name}: {r['tokens_per_s']:.1f} tok/s", flush=True))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratio = {k: med["new"][k] / med["old"][k] for k in med["new"]}
    print(table([{"figure": k, "old median": med["old"][k], "new median": med["new"][k], "new/old": ratio[k]}
                 for k in ratio], ["figure", "old median", "new median", "new/old"]))
    return {"prompts": args.prompts, "group": args.group, "runs": runs, "median": med, "new_over_old": ratio}


def engine_tok_s(tree: Path, batch: int, tokens: int, reps: int) -> float:
    """The engine's best tokens/s of `reps` equal calls, in a fresh process importing `tree`'s code."""
    out = subprocess.run([sys.executable, "-c", ENGINE_TIME, str(tree), str(batch), str(tokens), str(reps)],
                         cwd=tree, check=True, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    return float(out.stdout.strip().splitlines()[-1])


def direct(args, old: Path) -> dict:
    speeds: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for _ in range(args.reps):
        for b in args.batch_sizes:
            for name, tree in (("old", old), ("new", ROOT)):
                v = engine_tok_s(tree, b, args.max_new_tokens, args.direct_reps)
                speeds[name].setdefault(str(b), []).append(v)
                print(f"direct {name} batch {b}: {v:.1f} tok/s", flush=True)
    ratio = {str(b): statistics.median(speeds["new"][str(b)]) / statistics.median(speeds["old"][str(b)])
             for b in args.batch_sizes}
    print(table([{"batch": b, "new/old engine speed": ratio[str(b)]} for b in args.batch_sizes],
                ["batch", "new/old engine speed"]))
    return {"tok_s": speeds, "new_over_old": ratio}


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--old", required=True, help="the other checkout (e.g. a git worktree of the base commit)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2, help="alternations old, new, old, new, ...")
    p.add_argument("--direct", action="store_true", help="also time the two engines against each other")
    p.add_argument("--direct-only", action="store_true", help="only the direct engine-vs-engine timing")
    p.add_argument("--direct-reps", type=int, default=3, help="calls per direct timing (the best counts)")
    p.add_argument("--longtail", action="store_true", help="only the engine on the long-tail workload, alternated")
    p.add_argument("--prompts", type=int, default=4, help="--longtail: prompts per call")
    p.add_argument("--group", type=int, default=8, help="--longtail: samples per prompt")
    p.add_argument("--out", default="bench_out/cpu_ab.json")
    args = p.parse_args()
    old = Path(args.old).resolve()
    if args.longtail:
        write_json(args.out, {"old": str(args.old), "max_new_tokens": args.max_new_tokens,
                              "longtail": longtail(args, old)})
        return 0
    if args.direct_only:
        write_json(args.out, {"old": str(args.old), "max_new_tokens": args.max_new_tokens,
                              "direct": direct(args, old)})
        return 0
    runs = alternated(args.reps, old, lambda tree: run_once(tree, args.batch_sizes, args.max_new_tokens),
                      lambda name, r: print(name, r, flush=True))
    medians = {name: {str(b): statistics.median(r[str(b)] for r in rs) for b in args.batch_sizes}
               for name, rs in runs.items()}
    cols = ["batch", "old engine/HF", "new engine/HF", "old median", "new median"]
    rows = [dict(zip(cols, [b, " ".join(f"{r[str(b)]:.2f}" for r in runs["old"]),
                            " ".join(f"{r[str(b)]:.2f}" for r in runs["new"]),
                            medians["old"][str(b)], medians["new"][str(b)]])) for b in args.batch_sizes]
    print(table(rows, cols))
    result = {"old": str(args.old), "runs": runs, "median_ratio": medians, "max_new_tokens": args.max_new_tokens}
    if args.direct:
        result["direct"] = direct(args, old)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
