"""Accepted tokens per verify of one EAGLE-3 export: rlspec's engine vs vLLM, same prompts, per temperature.

Issue 29's first check: at the temperature RL samples at, does vLLM gain from rlspec's drafter as the
engine does? Every row is a chain of --k drafts at every step (no selector), the same P prompts x G
samples, --max-new-tokens, natural EOS. Rows:

- engine:  rlspec's RolloutEngine with the export loaded (drafter_path), drafts sampled from q (its rule)
- vllm:    vLLM (method eagle3) with the same export, draft_sample_method greedy (vLLM's default) and,
           with --probabilistic, "probabilistic"
- vllm-noseed: as vllm without per-request seeds (rules vLLM's seeded generators in or out)

Each vLLM row runs in a process of its own. Run inside .venv-vllm:

    .venv-vllm/bin/python scripts/vllm_acceptance.py --drafter-path outputs/drafter_warm \
        --out bench_out/vllm_acceptance.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import math_prompts, parser, table, write_json


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter-path", required=True)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    p.add_argument("--rows", nargs="+", default=["engine", "vllm", "vllm-probabilistic"])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-fix", action="store_true", help="leave vLLM's CPU temperature bug in (rollout/vllm_backend/cpu_fixes.py)")
    p.add_argument("--out", default="bench_out/vllm_acceptance.json")
    p.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: one row, its JSON printed
    return p.parse_args(argv)


def run_engine(args, temperature: float) -> dict:
    import torch

    from rollout.engine import RolloutEngine
    from rollout.types import SamplingParams, SpecConfig
    from transformers import AutoTokenizer

    from rollout.runtime.model.fetch import fetch_model

    model_dir = fetch_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=args.k, selector="always", online_training=False,
                      drafter_path=args.drafter_path)
    eng = RolloutEngine.from_pretrained(args.model, spec=spec, dtype=getattr(torch, args.dtype), max_model_len=1024,
                                        max_num_seqs=args.prompts * args.group)
    t0 = time.perf_counter()
    out = eng.generate(math_prompts(tok, args.prompts), SamplingParams(temperature=temperature, n=args.group,
                                                                       max_new_tokens=args.max_new_tokens, seed=0))
    s = eng.stats()
    eng.close()
    return {"accept_len": s.get("rollout/accept_len", 1.0), "tokens": sum(len(r.completion_ids) for r in out),
            "wall_s": time.perf_counter() - t0}


def run_vllm(args, temperature: float, row: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rollout.runtime.model.fetch import fetch_model
    from rollout.vllm_backend import cpu_fixes
    from rollout.vllm_backend.weights import spec_counters

    if not args.no_fix:
        cpu_fixes.apply()  # what the backend does on CPU

    model_dir = fetch_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    spec = {"method": "eagle3", "model": args.drafter_path, "num_speculative_tokens": args.k}
    if row == "vllm-probabilistic":
        spec["draft_sample_method"] = "probabilistic"
    rows = args.prompts * args.group
    llm = LLM(model=model_dir, dtype=args.dtype, max_model_len=1024, max_num_seqs=rows, enforce_eager=True,
              speculative_config=spec, disable_log_stats=False, seed=0, kv_cache_memory_bytes=2**30)
    prompts = math_prompts(tok, args.prompts)
    requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(args.group)]
    eos = [tok.eos_token_id]
    params = [SamplingParams(temperature=temperature, max_tokens=args.max_new_tokens, stop_token_ids=eos,
                             seed=None if row == "vllm-noseed" else i, detokenize=False)
              for i in range(len(requests))]
    t0 = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    c = spec_counters(llm)
    return {"accept_len": 1.0 + c["accepted"] / max(c["drafts"], 1), "drafts": c["drafts"],
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall_s": time.perf_counter() - t0}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        row, temperature = args.one[0], float(args.one[1])
        res = run_engine(args, temperature) if row == "engine" else run_vllm(args, temperature, row)
        print("RESULT " + json.dumps(res), flush=True)
        return
    results = []
    for temperature in args.temperatures:
        for row in args.rows:
            cmd = [sys.executable, __file__, "--one", row, str(temperature), "--drafter-path", args.drafter_path,
                   "--k", str(args.k), "--prompts", str(args.prompts), "--group", str(args.group),
                   "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype, "--model", args.model,
                   *(["--no-fix"] if args.no_fix else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                results.append({"row": row, "temperature": temperature, "error": proc.stderr[-2000:]})
                print(f"{row} T={temperature}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append({"row": row, "temperature": temperature, **json.loads(line[len("RESULT "):])})
            print(table([results[-1]], ["row", "temperature", "accept_len", "tokens", "wall_s"]), flush=True)
    ok = [r for r in results if "error" not in r]
    print(table(ok, ["row", "temperature", "accept_len", "tokens", "wall_s"]))
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "one"}, "rows": results})


if __name__ == "__main__":
    main()
