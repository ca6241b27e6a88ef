"""Rollout throughput: HF transformers `generate` vs rlspec's `RolloutEngine.generate`.

Both backends decode the same chat prompts at each batch size with the same dtype and sampling
settings, EOS ignored so every sample runs exactly --max-new-tokens tokens (equal work). One
warmup call per backend and batch size precedes each timed call. Prints a table and writes JSON:
{config, results: [{batch, backend, tokens, seconds, tokens_per_s}], ratio: {batch: engine/hf}}.

    python scripts/bench_rollout.py --model smollm2-135m-instruct --batch-sizes 1 8 \
        --max-new-tokens 128 --dtype bfloat16 --out bench_out/rollout.json
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

from common import parser, write_json  # first: it puts the repo on sys.path
from bench_engine import completion_tokens, hf_model, timed

import torch

from rollout.runtime.model.fetch import fetch_model

FALLBACK_QUESTIONS = [
    "What is 7 + 5?", "Tom has 3 apples and buys 4 more. How many apples does Tom have now?",
    "What is 9 * 6?", "Anna has 8 stickers and gives away 2. How many are left?",
    "Explain in one sentence why the sky is blue.", "Name three prime numbers.",
    "What is 12 - 7?", "Write a haiku about autumn.",
]
BACKENDS = ("hf", "engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct", help="local HF dir, hub id or embedded alias")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="prompts per generate call")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per sample (EOS is ignored)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and compute")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both backends)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; otherwise plain sampling")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (both backends)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS, help="what to measure")
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of the untimed warmup call")
    p.add_argument("--out", default=None, help="where to write the JSON results (default bench_out/<workload>.json)")
    p.add_argument("--workload", default="fixed", choices=["fixed", "longtail"],
                   help="fixed: equal-length samples vs HF; longtail: GRPO-shaped, natural EOS (scripts/longtail.py)")
    p.add_argument("--prompts", type=int, default=4, help="longtail: prompts per rollout")
    p.add_argument("--group", type=int, default=8, help="longtail: samples per prompt (GRPO group size)")
    p.add_argument("--reps", type=int, default=3, help="longtail: repetitions (fresh prompts each)")
    p.add_argument("--tail-live", type=int, default=None,
                   help="longtail: the tail is when at most this many sequences are live (default: a quarter)")
    p.add_argument("--drafter-path", default=None, help="longtail: trained EAGLE-3 drafter for the eagle3/auto configs")
    p.add_argument("--configs", nargs="+", default=["hf", "engine", "ngram", "suffix", "suffix-tree", "suffix-always",
                                                    "adaptive"],
                   help="longtail: which configurations to measure (see scripts/longtail.py CONFIGS)")
    args = p.parse_args(argv)
    args.out = args.out or f"bench_out/{'rollout' if args.workload == 'fixed' else 'longtail'}.json"
    return args


def build_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts as token ids: the embedded math set when trainers is importable, else a fixed list."""
    try:
        from trainers.data import make_math_dataset

        convs = list(make_math_dataset(num_examples=count, seed=0)["prompt"])
    except ImportError:
        convs = [[{"role": "user", "content": FALLBACK_QUESTIONS[i % len(FALLBACK_QUESTIONS)]}] for i in range(count)]
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in convs]


def hf_runner(path: str, dtype: torch.dtype, args: argparse.Namespace):
    """A function (prompts, max_new_tokens) -> generated token count, using HF `generate`."""
    tok, model = hf_model(path, dtype, args.device, padding_side="left")
    sampling = ({"do_sample": False} if args.temperature == 0 else
                {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0})

    def run(prompts: list[list[int]], max_new_tokens: int) -> int:
        batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(args.device)
        torch.manual_seed(args.seed)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=tok.pad_token_id, **sampling)
        return (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]

    return run


def engine_runner(model: str, args: argparse.Namespace, max_batch: int):
    """A function (prompts, max_new_tokens) -> generated token count, using RolloutEngine."""
    from rollout.engine import RolloutEngine
    from rollout.types import SamplingParams

    engine = RolloutEngine.from_pretrained(model, device=args.device, dtype=args.dtype, max_num_seqs=max_batch)

    def run(prompts: list[list[int]], max_new_tokens: int) -> int:
        params = SamplingParams(temperature=args.temperature, max_new_tokens=max_new_tokens,
                                seed=args.seed, ignore_eos=True)
        return completion_tokens(engine.generate(prompts, params))

    return run, engine


def measure(args: argparse.Namespace) -> dict:
    path = fetch_model(args.model)
    dtype = getattr(torch, args.dtype)
    from transformers import AutoTokenizer

    prompts = build_prompts(AutoTokenizer.from_pretrained(path), max(args.batch_sizes))
    runners, engine = {}, None
    if "hf" in args.backends:
        runners["hf"] = hf_runner(path, dtype, args)
    if "engine" in args.backends:
        runners["engine"], engine = engine_runner(args.model, args, max(args.batch_sizes))
    results = []
    for batch in args.batch_sizes:
        for backend, run in runners.items():
            status(f"batch {batch:>3} {backend:<6} warmup ({args.warmup_tokens} tokens)")
            run(prompts[:batch], args.warmup_tokens)
            if engine is not None:
                engine.stats()  # drop the warmup's metrics
            status(f"batch {batch:>3} {backend:<6} timed ({args.max_new_tokens} tokens x {batch})")
            tokens, seconds = timed(lambda: run(prompts[:batch], args.max_new_tokens), torch.device(args.device))
            row = {"batch": batch, "backend": backend, "tokens": tokens, "seconds": round(seconds, 4),
                   "tokens_per_s": round(tokens / seconds, 2)}
            if backend == "engine":
                row["stats"] = engine.stats()
            results.append(row)
            status(f"batch {batch:>3} {backend:<6} {row['tokens_per_s']:.1f} tok/s")
    return {"config": config_record(args, path, prompts), "results": results, "ratio": ratios(results)}


def ratios(results: list[dict]) -> dict[str, float]:
    """engine tok/s over hf tok/s per batch size (only where both were measured)."""
    by = {(r["batch"], r["backend"]): r["tokens_per_s"] for r in results}
    return {str(b): round(by[(b, "engine")] / by[(b, "hf")], 3)
            for b, backend in by if backend == "hf" and (b, "engine") in by}


def config_record(args: argparse.Namespace, path: str, prompts: list[list[int]]) -> dict:
    return {**vars(args), "model_path": path, "torch": torch.__version__, "num_threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor() or platform.platform(),
            "cpu_count": os.cpu_count(),
            # other processes on a shared machine skew timings: record how busy it was
            "loadavg_1m": round(os.getloadavg()[0], 2), "prompt_lens": [len(p) for p in prompts]}


def print_table(report: dict) -> None:
    print(f"\n{'batch':>5} {'backend':<7} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs hf':>6}")
    for r in report["results"]:
        ratio = report["ratio"].get(str(r["batch"])) if r["backend"] == "engine" else None
        print(f"{r['batch']:>5} {r['backend']:<7} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.1f} "
              f"{f'{ratio:.2f}x' if ratio else '':>6}")


def status(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workload == "longtail":
        from longtail import run_longtail

        run_longtail(args)
        return 0
    report = measure(args)
    print_table(report)
    print()
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
