"""Rollout throughput: rlspec's engine against transformers `generate`, on two workloads.

  fixed     the same chat prompts at each batch size, EOS ignored so every sample runs exactly
            --max-new-tokens tokens (equal work); the arms (hf, engine) alternate over --reps repetitions,
            one warm-up call each first; the figure is the median one-run ratio engine / hf per batch size.
  longtail  GRPO-shaped: --prompts prompts x --group samples at T=1 until EOS, so the live batch drains into a
            long tail as in RL; every --configs entry (hf, plain engine, each speculative configuration) runs on
            the same fresh prompts per repetition in rotating order; tokens/s overall, in the full batch and in
            the tail (rlspec/bench/longtail.py).
  repeat    greedy (T=0) continuations of prompts that ask to repeat a passage: a workload where a drafter clearly
            pays, --prompts x --group rows, the long tail's configurations and figures.
  --old DIR the engine of another checkout (e.g. `git worktree add /tmp/old <commit>`) against this one on the
            chosen workload, alternated in fresh processes: the before/after of a change in one sitting, as a
            ratio of medians (absolute speed on a shared machine drifts 20-30% between sittings).

    python -m rlspec.bench rollout --batch-sizes 1 8 --max-new-tokens 128
    python -m rlspec.bench rollout --workload longtail --configs hf engine suffix adaptive
    python -m rlspec.bench rollout --workload longtail --configs engine --old /tmp/old --reps 4
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, SMOKE_DTYPE, completion_tokens, hf_model, math_prompts, smoke_model, timed_on

NAME = "rollout"
HELP = "engine vs transformers generate: fixed-length batches and the GRPO-shaped long tail (--old: A/B checkouts)"


def add_arguments(p) -> None:
    from rlspec.bench.longtail import CONFIGS

    p.add_argument("--workload", default="fixed", choices=["fixed", "longtail", "repeat"])
    p.add_argument("--model", default=EMBEDDED, help="local HF dir, hub id or embedded alias")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and compute")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both backends)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="fixed: prompts per generate call")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per sample (fixed: EOS is ignored)")
    p.add_argument("--temperature", type=float, default=1.0, help="fixed: 0 = greedy; otherwise plain sampling")
    p.add_argument("--warmup-tokens", type=int, default=16, help="fixed: new tokens of the untimed warm-up call")
    p.add_argument("--prompts", type=int, default=4, help="longtail: prompts per rollout")
    p.add_argument("--group", type=int, default=8, help="longtail: samples per prompt (GRPO group size)")
    p.add_argument("--tail-live", type=int, default=None,
                   help="longtail: the tail is when at most this many sequences are live (default: a quarter)")
    p.add_argument("--drafter-path", default=None, help="longtail: a trained EAGLE-3 drafter for the learned configs")
    p.add_argument("--configs", nargs="+", default=["hf", "engine", "ngram", "suffix", "suffix-tree", "adaptive"],
                   choices=["hf", *CONFIGS], help="longtail: configurations (rlspec/bench/longtail.py CONFIGS)")
    p.add_argument("--old", type=Path, default=None, help="another checkout: its engine against this one's")


def run(args) -> dict:
    if args.smoke:
        args.dtype, args.batch_sizes, args.max_new_tokens, args.warmup_tokens = SMOKE_DTYPE, [1, 2], 4, 2
        args.prompts, args.group, args.reps, args.model = 2, 2, 1, smoke_model(args.model, args.out)
        if args.workload in ("longtail", "repeat"):
            args.configs = ["hf", "engine", "suffix"]
    if args.old is not None:
        return ab(args)
    if args.workload in ("longtail", "repeat"):
        from rlspec.bench.longtail import run_longtail

        return run_longtail(args)
    return fixed(args)


def _runner_hf(args):
    import torch

    tok, model = hf_model(args.model, args.dtype, args.device, padding_side="left")
    sampling = ({"do_sample": False} if args.temperature == 0 else
                {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0})

    def gen(prompts, max_new_tokens: int) -> int:
        batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(args.device)
        torch.manual_seed(args.seed)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=tok.pad_token_id, **sampling)
        return (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]

    return tok, gen


def _runner_engine(args):
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.types import SamplingParams

    engine = RolloutEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                           max_num_seqs=max(args.batch_sizes))

    def gen(prompts, max_new_tokens: int) -> int:
        params = SamplingParams(temperature=args.temperature, max_new_tokens=max_new_tokens, seed=args.seed,
                                ignore_eos=True)
        return completion_tokens(engine.generate(prompts, params))

    return gen


def fixed(args) -> dict:
    import torch

    tok, hf = _runner_hf(args)
    runners = {"hf": hf, "engine": _runner_engine(args)}
    prompts = math_prompts(tok, max(args.batch_sizes), seed=args.seed)
    device = torch.device(args.device)
    rows, ratio = [], {}
    for batch in args.batch_sizes:
        ps = prompts[:batch]
        for gen in runners.values():
            gen(ps, args.warmup_tokens)

        def arm(gen):
            return lambda rep: (lambda r: r[0] / r[1])(timed_on(lambda: gen(ps, args.max_new_tokens), device))

        runs = harness.alternate({name: arm(gen) for name, gen in runners.items()}, args.reps,
                                 lambda n, rep, v: print(f"[rollout] batch {batch} rep {rep} {n}: {v:.1f} tok/s",
                                                         flush=True))
        med = harness.medians(runs)
        ratio[str(batch)] = statistics.median(harness.ratios(runs, "hf")["engine"])
        rows += [{"batch": batch, "backend": n, "tokens_per_s": med[n], "runs": runs[n],
                  "engine_over_hf": ratio[str(batch)] if n == "engine" else None} for n in runners]
    return {"workload": "fixed", "rows": rows, "ratio": ratio, "prompt_lens": [len(p) for p in prompts],
            "columns": ["batch", "backend", "tokens_per_s", "engine_over_hf"]}


def _flags(args) -> list[str]:
    """This run's workload flags, for the other checkout's run of one repetition."""
    flags = ["--workload", args.workload, "--model", args.model, "--dtype", args.dtype, "--reps", "1",
             "--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed)]
    if args.workload == "fixed":
        return flags + ["--batch-sizes", *map(str, args.batch_sizes)]
    return flags + ["--configs", "engine", "--prompts", str(args.prompts), "--group", str(args.group)]


def _report_of(tree: Path, flags: list[str]) -> dict:
    """The report of `tree`'s own rollout benchmark run with `flags` in a fresh process importing `tree`'s code
    (rlspec.bench where the checkout has it, else its scripts/bench_rollout.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        entry = (["-m", "rlspec.bench", "rollout"] if (tree / "rlspec/bench/__main__.py").is_file()
                 else [str(tree / "scripts/bench_rollout.py")])
        env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, *entry, *flags, "--out", str(out)], cwd=tree, check=True, env=env)
        return json.loads(out.read_text())


def _figures(report: dict, workload: str) -> dict[str, float]:
    rows = report.get("rows") or report["results"]
    if workload == "fixed":
        if "ratio" in report:
            return {f"batch {b}: engine/hf": float(v) for b, v in report["ratio"].items()}
    r = next(r for r in rows if r.get("config") == "engine")
    return {k: float(r[k]) for k in ("tokens_per_s", "full_tokens_per_s", "tail_tokens_per_s")}


def ab(args) -> dict:
    """The other checkout and this one, alternated `--reps` times, each a fresh process; medians and new/old."""
    old, new = args.old.resolve(), harness.ROOT
    runs = harness.alternate({"old": lambda rep: _figures(_report_of(old, _flags(args)), args.workload),
                              "new": lambda rep: _figures(_report_of(new, _flags(args)), args.workload)},
                             args.reps, lambda n, rep, v: print(f"[rollout] A/B rep {rep} {n}: {v}", flush=True))
    keys = list(runs["new"][0])
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in keys} for arm, rs in runs.items()}
    rows = [{"figure": k, "old": med["old"][k], "new": med["new"][k], "new_over_old": med["new"][k] / med["old"][k]}
            for k in keys]
    return {"workload": args.workload, "old": str(old), "runs": runs, "rows": rows}


def plot(report: dict, path: str) -> None:
    """longtail: rlspec/bench/longtail.py's picture; fixed: tokens/s per batch size and backend."""
    if report["workload"] in ("longtail", "repeat") and "traces" in report:
        from rlspec.bench.longtail import plot as longtail_plot

        return longtail_plot(report, path)
    if report["workload"] != "fixed" or "old" in report:
        return None
    with harness.png(path, figsize=(6, 3.5)) as (fig, ax):
        for name in ("hf", "engine"):
            pts = [(r["batch"], r["tokens_per_s"]) for r in report["rows"] if r["backend"] == name]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s (median)")
        ax.set_title("rollout throughput, equal-length samples")
        ax.legend()
        ax.grid(alpha=0.3)
