"""rlspec's engine vs the vLLM backend (rollout.backend=vllm) on the long-tail workload, without and with
speculation, plus the EAGLE-3 export's accepted length in vLLM. Run inside .venv-vllm (`make vllm-venv`).

Workload (as scripts/longtail.py): P prompts of the embedded math task x G samples at T=1 until EOS or
--max-new-tokens, so the live batch drains into a long tail as in GRPO. Every config gets the same
prompts; each runs in a process of its own (a vLLM per process: vLLM 0.32's n-gram drafter breaks a second
vLLM in the same process, docs/vllm_backend.md#known-vllm-issues), is warmed up with one small call, then
timed over --reps calls. The learned drafter is rlspec's warm-started one for the model (cached under
$RLSPEC_CACHE/drafters; --drafter-path to give another EAGLE-3 directory), never trained while measured.

    .venv-vllm/bin/python scripts/bench_vllm.py --out bench_out/vllm_backend.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import math_prompts, parser, table, write_json
from bench_engine import hf_model, timed_generate

# name: (backend, drafter, k, selector); fixed = the long-tail policy (a per-batch-size depth table in vLLM)
CONFIGS = {
    "engine": ("engine", "none", 4, "fixed"),
    "engine-eagle3": ("engine", "eagle3", 4, "fixed"),
    "engine-ngram": ("engine", "ngram", 4, "fixed"),
    "vllm": ("vllm", "none", 4, "fixed"),
    "vllm-eagle3": ("vllm", "eagle3", 4, "fixed"),
    "vllm-eagle3-always": ("vllm", "eagle3", 3, "always"),  # the export's accepted length at every step
    "vllm-ngram": ("vllm", "ngram", 4, "fixed"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--prompts", type=int, default=16, help="P prompts per call")
    p.add_argument("--group", type=int, default=8, help="G samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=2, help="timed calls per config (fresh prompts each)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter-path", default=None, help="EAGLE-3 directory (default: rlspec's cached warm start)")
    p.add_argument("--warm-start-s", type=float, default=180.0, help="warm-start budget when nothing is cached")
    p.add_argument("--out", default="bench_out/vllm_backend.json")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one config, print its JSON
    return p.parse_args(argv)


def trained_drafter(model_dir: str, tokenizer, args) -> str:
    """rlspec's warm-started EAGLE-3 drafter for the model (loaded from the cache when there)."""
    if args.drafter_path:
        return args.drafter_path
    from rollout.engine import RolloutEngine
    from rollout.speculation.warm_start import warm_start
    from rollout.types import SpecConfig

    engine = RolloutEngine.from_pretrained(model_dir, spec=SpecConfig(drafter="eagle3", online_training=False),
                                           dtype=args.dtype, max_num_seqs=16)
    result = warm_start(engine, math_prompts(tokenizer, 64), budget_s=args.warm_start_s, group=4,
                        max_new_tokens=128, use_tqdm=False)
    engine.close()
    return result.path


def run_one(args) -> dict:
    """Build one config's backend from the HF model, warm it up, time args.reps calls."""
    import torch

    from rollout.backend import build_backend
    from rollout.types import SamplingParams, SpecConfig

    backend_name, drafter, k, selector = CONFIGS[args.one]
    tok, policy = hf_model(args.model, getattr(torch, args.dtype))
    spec = SpecConfig(drafter=drafter, num_draft_tokens=k, selector=selector, online_training=False,
                      drafter_path=args.drafter_path if drafter == "eagle3" else None)
    rows = args.prompts * args.group
    t0 = time.perf_counter()
    backend = build_backend(backend_name, policy, tok, spec, dtype=args.dtype, max_model_len=1024, max_num_seqs=rows)
    build_s = time.perf_counter() - t0
    backend.generate(math_prompts(tok, 2, seed=999), SamplingParams(n=2, max_new_tokens=8, seed=0))  # warm-up
    backend.stats()
    tokens, wall = 0, 0.0
    for rep in range(args.reps):
        prompts = math_prompts(tok, args.prompts, seed=rep)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.group, seed=rep)
        _, n, seconds = timed_generate(backend, prompts, params)
        tokens, wall = tokens + n, wall + seconds
    s = backend.stats()
    table_ = getattr(backend, "depth_table", None)
    backend.close()
    return {"config": args.one, "backend": backend_name, "drafter": drafter, "k": k, "selector": selector,
            "build_s": build_s, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "accept_len": s.get("rollout/accept_len", 1.0), "accept_rate": s.get("rollout/accept_rate", 0.0),
            "spec_step_share": s.get("rollout/spec_step_share"), "depth_table": table_.as_vllm() if table_ else None}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    from transformers import AutoTokenizer

    from rollout.runtime.model.fetch import fetch_model

    model_dir = fetch_model(args.model)
    needs_drafter = any(CONFIGS[c][1] == "eagle3" for c in args.configs)
    drafter = trained_drafter(model_dir, AutoTokenizer.from_pretrained(model_dir), args) if needs_drafter else None
    rows = []
    for name in args.configs:
        cmd = [sys.executable, __file__, "--one", name, *_passthrough(args), *(["--drafter-path", drafter] if drafter
                                                                               else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ,
                                                                         "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            rows.append({"config": name, "error": proc.stderr.strip().splitlines()[-1:] or ["no output"]})
            print(f"{name}: failed: {rows[-1]['error']}", file=sys.stderr)
            continue
        rows.append(json.loads(line[len("RESULT "):]))
        print(table([rows[-1]], ["config", "tokens", "wall_s", "tokens_per_s", "accept_len", "build_s"]), flush=True)
    ok = [r for r in rows if "error" not in r]
    print(table(ok, ["config", "tokens", "wall_s", "tokens_per_s", "accept_len", "accept_rate", "build_s"]))
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "one"}, "drafter": drafter,
                          "rows": rows})


def _passthrough(args) -> list[str]:
    return ["--model", args.model, "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens",
            str(args.max_new_tokens), "--reps", str(args.reps), "--dtype", args.dtype]


if __name__ == "__main__":
    main()
