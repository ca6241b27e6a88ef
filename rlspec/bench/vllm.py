"""rlspec's engine against the vLLM backend (rollout.backend=vllm), run inside .venv-vllm (`make vllm-venv`).

  speed   (default) the long-tail workload (P prompts x G samples at T=1 until EOS or --max-new-tokens, as in
          GRPO) per config, without and with speculation; each config in a process of its own (vLLM 0.32's n-gram
          drafter breaks a second vLLM in the same process: docs/vllm_backend.md#known-vllm-issues), warmed up with
          one small call, then timed over --reps calls on fresh prompts. The learned drafter is rlspec's
          warm-started one for the model (cached under $RLSPEC_CACHE/drafters; --drafter-path for another EAGLE-3
          directory), never trained while measured.
  online  GRPO on the vLLM backend with the learned drafter trained online from cold (rlspec/bench/vllm_online.py):
          does vLLM's accepted length rise as the drafter versions pushed into it improve?

    .venv-vllm/bin/python -m rlspec.bench vllm
    .venv-vllm/bin/python -m rlspec.bench vllm --part online --steps 30
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlspec.bench.common import EMBEDDED, SMOKE_DTYPE, hf_model, math_prompts, smoke_model, timed_generate

NAME = "vllm"
HELP = "engine vs the vLLM backend on the long tail, with and without speculation; --part online: GRPO on vLLM"
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


def add_arguments(p) -> None:
    p.add_argument("--part", default="speed", choices=["speed", "online"])
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--prompts", type=int, default=16, help="P prompts per call")
    p.add_argument("--group", type=int, default=8, help="G samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter-path", default=None, help="EAGLE-3 directory (default: rlspec's cached warm start)")
    p.add_argument("--warm-start-s", type=float, default=180.0, help="warm-start budget when nothing is cached")
    p.add_argument("--one", default=None, help="run this one config in this process (what each child does)")
    p.add_argument("--config", default="grpo_math.yaml", help="online: the training config")
    p.add_argument("--steps", type=int, default=30, help="online: GRPO steps")
    p.add_argument("--window", type=int, default=5, help="online: steps compared at the start and the end")
    p.add_argument("--workdir", default="outputs/bench_vllm_online", help="online: the run's directory")
    p.add_argument("--overrides", nargs="*", default=[], help="online: extra key=value for the run")
    p.add_argument("--reuse", action="store_true", help="online: read a run that already finished in --workdir")


def run(args) -> dict:
    if args.part == "online":
        from rlspec.bench.vllm_online import run_online

        return run_online(args)
    if args.smoke:
        has_vllm = importlib.util.find_spec("vllm") is not None
        args.configs = ["engine", "engine-ngram", *(["vllm"] if has_vllm else [])]
        args.dtype, args.prompts, args.group, args.max_new_tokens, args.reps = SMOKE_DTYPE, 2, 2, 8, 1
        args.model = smoke_model(args.model, args.out)
    if args.one:
        return {"rows": [run_one(args)]}
    needs_drafter = any(CONFIGS[c][1] == "eagle3" for c in args.configs)
    drafter = trained_drafter(args) if needs_drafter else None
    rows = [run_one(args, name) if args.smoke and CONFIGS[name][0] == "engine" else _child(args, name, drafter)
            for name in args.configs]
    return {"part": "speed", "drafter": drafter, "rows": rows, "no_plot": True,
            "columns": ["config", "tokens", "wall_s", "tokens_per_s", "accept_len", "accept_rate", "build_s", "error"]}


def _child(args, name: str, drafter: str | None) -> dict:
    """One config in a fresh process (`--one`), its row read back from the report it writes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, "-m", "rlspec.bench", "vllm", "--one", name, "--out", str(out), "--model", args.model,
               "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens",
               str(args.max_new_tokens), "--reps", str(args.reps), "--dtype", args.dtype,
               *(["--drafter-path", drafter] if drafter else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        if proc.returncode != 0 or not out.is_file():
            print(f"{name}: failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return {"config": name, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        return json.loads(out.read_text())["rows"][0]


def trained_drafter(args) -> str:
    """rlspec's warm-started EAGLE-3 drafter for the model (loaded from the cache when there)."""
    if args.drafter_path:
        return args.drafter_path
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.speculation.training.warm_start import warm_start
    from rlspec.rollout.types import SpecConfig

    engine = RolloutEngine.from_pretrained(args.model, spec=SpecConfig(drafter="eagle3", online_training=False),
                                           dtype=args.dtype, max_num_seqs=16)
    result = warm_start(engine, math_prompts(engine.tokenizer, 64), budget_s=args.warm_start_s, group=4,
                        max_new_tokens=128, use_tqdm=False)
    engine.close()
    return result.path


def run_one(args, name: str | None = None) -> dict:
    """Build one config's backend from the HF model, warm it up, time args.reps calls."""
    from rlspec.rollout.backend import build_backend
    from rlspec.rollout.types import SamplingParams, SpecConfig

    name = name or args.one
    backend_name, drafter, k, selector = CONFIGS[name]
    tok, policy = hf_model(args.model, args.dtype)
    spec = SpecConfig(drafter=drafter, num_draft_tokens=k, selector=selector, online_training=False,
                      drafter_path=args.drafter_path if drafter == "eagle3" else None)
    t0 = time.perf_counter()
    backend = build_backend(backend_name, policy, tok, spec, dtype=args.dtype, max_model_len=1024,
                            max_num_seqs=args.prompts * args.group)
    build_s = time.perf_counter() - t0
    backend.generate(math_prompts(tok, 2, seed=999), SamplingParams(n=2, max_new_tokens=8, seed=0))  # warm-up
    backend.stats()
    tokens, wall = 0, 0.0
    for rep in range(args.reps):
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.group, seed=rep)
        _, n, seconds = timed_generate(backend, math_prompts(tok, args.prompts, seed=rep), params)
        tokens, wall = tokens + n, wall + seconds
    s = backend.stats()
    depth = getattr(backend, "depth_table", None)
    backend.close()
    return {"config": name, "backend": backend_name, "drafter": drafter, "k": k, "selector": selector,
            "build_s": build_s, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "accept_len": s.get("rollout/accept_len", 1.0), "accept_rate": s.get("rollout/accept_rate", 0.0),
            "spec_step_share": s.get("rollout/spec_step_share"), "depth_table": depth.as_vllm() if depth else None}


def plot(report: dict, path: str) -> None:
    if report.get("part") == "online":
        from rlspec.bench.vllm_online import plot as online_plot

        online_plot(report, path)
