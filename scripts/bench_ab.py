"""Before/after in one sitting: `bench_rollout.py` of another checkout against this one, alternated.

Absolute speed on shared machines drifts 20-30% between runs, so a regression check compares the
engine/transformers ratio of two checkouts measured back to back, several times, alternating:

    git worktree add /tmp/rlspec-old <commit>
    python scripts/bench_ab.py --old /tmp/rlspec-old --reps 2 --out bench_out/cpu_ab.json

Prints, per batch size, each run's engine/HF ratio and the medians; writes them to JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_json  # noqa: E402

HERE = Path(__file__).resolve().parents[1]


def run_once(tree: Path, batch_sizes: list[int], tokens: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, str(tree / "scripts" / "bench_rollout.py"), "--batch-sizes", *map(str, batch_sizes),
               "--max-new-tokens", str(tokens), "--out", str(out)]
        subprocess.run(cmd, cwd=tree, check=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin",
                                                         "HF_HUB_OFFLINE": "1"})
        return {str(k): float(v) for k, v in json.loads(out.read_text())["ratio"].items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the other checkout (e.g. a git worktree of the base commit)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2, help="alternations old, new, old, new, ...")
    p.add_argument("--out", default="bench_out/cpu_ab.json")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(args.reps):
        for name, tree in (("old", Path(args.old).resolve()), ("new", HERE)):
            runs[name].append(run_once(tree, args.batch_sizes, args.max_new_tokens))
            print(name, runs[name][-1], flush=True)
    medians = {name: {str(b): statistics.median(r[str(b)] for r in rs) for b in args.batch_sizes}
               for name, rs in runs.items()}
    cols = ["batch", "old engine/HF", "new engine/HF", "old median", "new median"]
    rows = [dict(zip(cols, [b, " ".join(f"{r[str(b)]:.2f}" for r in runs["old"]),
                            " ".join(f"{r[str(b)]:.2f}" for r in runs["new"]),
                            medians["old"][str(b)], medians["new"][str(b)]])) for b in args.batch_sizes]
    print(table(rows, cols))
    write_json(args.out, {"old": str(args.old), "runs": runs, "median_ratio": medians,
                          "max_new_tokens": args.max_new_tokens})
    return 0


if __name__ == "__main__":
    sys.exit(main())
