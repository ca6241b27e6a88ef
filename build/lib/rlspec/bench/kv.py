"""KV memory: what a GRPO rollout's KV cache needs, and whether the default pool lives under a memory limit.

  memory  (default) the paged cache against contiguous rows on a simulated GRPO rollout, from the engine's own
          scheduler, allocator, budget and paged cache, no forward (rlspec/bench/kv_memory.py): peak KV memory,
          sequences in flight, preemptions, decode steps, at --budget-gb and a tight --tight-budget-gb.
  growth  the default KV memory under an address-space limit: RLIMIT_AS is set first (as `ulimit -v`; before torch
          is imported, so it covers everything the process maps), then one `generate` of --prompts x --n sequences
          with up to --max-new-tokens each on the embedded model with the engine's default KV memory (the pool
          follows the tokens and grows). Reports the address space the imports and the model take, the limits the
          budget saw, the pool's size, growths and peak against rows x cap, and the preemptions.
          --fixed-rows-x-cap runs the same call with a pool of rows x cap blocks instead, expected to fail to
          allocate under the limit.

    python -m rlspec.bench kv                                        # Qwen2.5-7B shape, 512 sequences, ~1 min
    python -m rlspec.bench kv --part growth --prompts 16 --n 16 --max-new-tokens 4096 --limit-gb 16
    python -m rlspec.bench kv --part growth --fixed-rows-x-cap
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import time

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, completion_tokens, math_prompts

NAME = "kv"
HELP = "KV memory: paged vs contiguous on a simulated GRPO rollout (--part memory), growth under RLIMIT_AS (growth)"
DEFAULTS = {"memory": dict(prompts=32, n=16, max_new_tokens=8192),
            "growth": dict(prompts=16, n=16, max_new_tokens=4096)}


def add_arguments(p) -> None:
    p.add_argument("--part", default="memory", choices=["memory", "growth"])
    p.add_argument("--prompts", type=int, default=None, help="prompts (memory: 32, growth: 16)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (16)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap per sample (memory: 8192, growth: 4096)")
    p.add_argument("--budget-gb", type=float, default=40.0, help="memory: the KV budget")
    p.add_argument("--tight-budget-gb", type=float, default=8.0, help="memory: a second paged run under this "
                   "budget, to show preemption (0: skip)")
    p.add_argument("--block-size", type=int, default=16, help="memory: tokens per KV block")
    p.add_argument("--drafter-layers", type=int, default=1, help="memory: EAGLE-3 KV layers in the pool (0: none)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512], help="memory: prompt lengths, uniform")
    p.add_argument("--median", type=float, default=900.0, help="memory: median completion length (lognormal body)")
    p.add_argument("--sigma", type=float, default=0.8, help="memory: lognormal sigma of the body")
    p.add_argument("--cap-share", type=float, default=0.07, help="memory: share of completions that run to the cap")
    p.add_argument("--tokens-per-step", type=int, default=1, help="memory: tokens a step emits per live sequence")
    p.add_argument("--limit-gb", type=float, default=16.0, help="growth: RLIMIT_AS in GiB (0: no limit)")
    p.add_argument("--temperature", type=float, default=1.0, help="growth: sampling temperature")
    p.add_argument("--device", default="cpu", help="growth: device")
    p.add_argument("--dtype", default="bfloat16", help="growth: dtype")
    p.add_argument("--fixed-rows-x-cap", action="store_true", help="growth: a fixed pool of rows x cap blocks")
    p.add_argument("--time-limit-s", type=float, default=0, help="growth: report the pool after this long, the call "
                   "still running (0: wait for the call to finish)")


def run(args) -> dict:
    for key, value in DEFAULTS[args.part].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.part == "memory":
        from rlspec.bench.kv_memory import run_memory

        return run_memory(args)
    if args.smoke:
        args.prompts, args.n, args.max_new_tokens = 1, 2, 4
    report = growth(args)
    if report["ok"] == "running":  # the call's thread is still decoding: write the report, leave without it
        harness.finish(sys.modules[__name__], args, report, sys.argv[2:])
        os._exit(0)
    return report


def plot(report: dict, path: str) -> None:
    if report["part"] == "memory":
        from rlspec.bench.kv_memory import plot_memory

        plot_memory(report, path)


def set_limit(gib: float) -> None:
    if gib > 0:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def vm_gib(field: str = "VmSize") -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2**20


def run_call(engine, prompts: list[list[int]], params, time_limit_s: float = 0) -> dict:
    """One generate call: what its pool did, or the error that stopped it. With a time limit the call runs in a
    thread and, if it is still running then, the pool is reported as it stands (ok "running"): at T=1 a few
    samples of the embedded model ramble to the 4096-token cap, which takes over an hour on 2 CPU cores."""
    t0, box = time.perf_counter(), {}

    def call():
        try:
            box["results"] = engine.generate(prompts, params, use_tqdm=True)
        except (RuntimeError, MemoryError, ValueError) as e:
            box["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(time_limit_s or None)
    if worker.is_alive():
        alloc = engine.runner.cache.alloc
        return dict(ok="running", seconds=time.perf_counter() - t0, pool_gib=engine.runner.cache.nbytes() / 2**30,
                    pool_blocks=alloc.capacity, peak_blocks=alloc.stats.peak_used, growths=alloc.stats.growths,
                    ceiling_blocks=alloc.max_blocks - 1)
    if "error" in box:
        e = box["error"]
        return dict(ok=False, error=str(e).splitlines()[0], seconds=time.perf_counter() - t0)
    results = box["results"]
    seconds, alloc, stats = time.perf_counter() - t0, engine.runner.cache.alloc, engine.stats()
    return dict(ok=True, seconds=seconds, tokens=completion_tokens(results),
                pool_gib=engine.runner.cache.nbytes() / 2**30, pool_blocks=alloc.capacity,
                peak_blocks=stats["rollout/kv_blocks_used"], growths=alloc.stats.growths,
                ceiling_blocks=alloc.max_blocks - 1, preemptions=stats["rollout/preemptions"])




def growth(args) -> dict:
    set_limit(args.limit_gb)
    from transformers import AutoConfig, AutoTokenizer

    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.kv_budget import memory_limits
    from rlspec.rollout.runtime.model.config import ModelConfig
    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.rollout.runtime.model.loader import resolve_dtype
    from rlspec.rollout.types import SamplingParams

    report = {"part": "growth", "vm_after_imports_gib": vm_gib()}
    path = fetch_model(EMBEDDED)
    prompts = math_prompts(AutoTokenizer.from_pretrained(path), args.prompts, seed=args.seed)
    rows, longest = args.prompts * args.n, max(map(len, prompts)) + args.max_new_tokens
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * resolve_dtype(args.dtype).itemsize
    report["rows_x_cap_gib"] = rows * (longest + 2) * per_token / 2**30  # + the pending and draft-slack positions
    kv = {"kv_memory_gb": report["rows_x_cap_gib"]} if args.fixed_rows_x_cap else {}
    engine = RolloutEngine.from_pretrained(path, device=args.device, dtype=args.dtype, max_model_len=longest,
                                           max_num_seqs=rows, **kv)
    report.update(vm_after_model_gib=vm_gib(), limits_gib={k: v / 2**30 for k, v in memory_limits(args.device).items()})
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, n=args.n, seed=args.seed)
    print(f"{rows} sequences, cap {args.max_new_tokens}, RLIMIT_AS {args.limit_gb:g} GiB, "
          f"VmSize {report['vm_after_model_gib']:.2f} GiB after the model; generating...", flush=True)
    report.update(run_call(engine, prompts, params, args.time_limit_s))
    report["vm_peak_gib"] = vm_gib("VmPeak")
    if report["ok"] is False:
        print("error:", report["error"])
    report["rows"] = [{k: v for k, v in report.items() if not isinstance(v, dict)}]
    report["columns"] = [c for c in ("ok", "rows_x_cap_gib", "pool_gib", "pool_blocks", "peak_blocks", "ceiling_blocks",
                                     "growths", "preemptions", "tokens", "seconds", "vm_after_model_gib",
                                     "vm_peak_gib") if c in report]
    return report
