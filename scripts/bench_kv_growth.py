"""Default KV memory under an address-space limit: the 256-sequence, cap-4096 call on the embedded model.

Sets RLIMIT_AS first (as `ulimit -v` would; before torch is imported, so the limit covers everything
the process maps), then runs one `generate` of --prompts x --n sequences with up to --max-new-tokens
each on SmolLM2-135M with the engine's default KV memory (no kv_memory_gb: the pool follows the tokens
and grows; docs/runtime.md#paged-kv-cache). Reports the address space the imports and the model take,
the limits the budget saw, the pool's size, growths and peak against rows x cap, and the preemptions.
--fixed-rows-x-cap runs the same call with a pool of rows x cap blocks instead (the old default's size),
which is expected to fail to allocate under the limit. Writes bench_out/kv_growth.json.

    python scripts/bench_kv_growth.py                     # 16 prompts x 16 samples, 4096 new tokens, 16 GiB
    python scripts/bench_kv_growth.py --fixed-rows-x-cap  # the rows x cap pool under the same limit
    python scripts/bench_kv_growth.py --prompts 2 --n 4 --max-new-tokens 8   # smoke: seconds
    python scripts/bench_kv_growth.py --time-limit-s 900  # report the pool after 15 min, the call still running
"""
from __future__ import annotations

import argparse
import os
import resource
import threading
import time

from common import math_prompts, parser, table, write_json  # light: main sets RLIMIT_AS before torch loads
from bench_engine import completion_tokens


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--limit-gb", type=float, default=16.0, help="RLIMIT_AS in GiB (0: no limit)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=16, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fixed-rows-x-cap", action="store_true", help="a fixed pool of rows x cap blocks instead")
    p.add_argument("--time-limit-s", type=float, default=0, help="stop watching after this long and report the "
                   "pool as it stands, the call still running (0: wait for the call to finish)")
    p.add_argument("--out", default="bench_out/kv_growth.json")
    return p.parse_args(argv)


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


def main(argv=None) -> dict:
    args = parse_args(argv)
    set_limit(args.limit_gb)
    from transformers import AutoConfig, AutoTokenizer

    from rollout.engine import RolloutEngine
    from rollout.runtime.kv_budget import memory_limits
    from rollout.runtime.model.config import ModelConfig
    from rollout.runtime.model.loader import resolve_dtype
    from rollout.runtime.model.fetch import fetch_model
    from rollout.types import SamplingParams

    report = {"config": vars(args), "vm_after_imports_gib": vm_gib()}
    path = fetch_model("smollm2-135m-instruct")
    prompts = math_prompts(AutoTokenizer.from_pretrained(path), args.prompts, seed=args.seed)
    rows, longest = args.prompts * args.n, max(map(len, prompts)) + args.max_new_tokens
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * resolve_dtype(args.dtype).itemsize
    report["rows_x_cap_gib"] = rows * (longest + 2) * per_token / 2**30  # + the pending and draft-slack positions
    kv = {"kv_memory_gb": report["rows_x_cap_gib"]} if args.fixed_rows_x_cap else {}  # the old default's size
    engine = RolloutEngine.from_pretrained(path, device=args.device, dtype=args.dtype, max_model_len=longest,
                                           max_num_seqs=rows, **kv)
    report.update(vm_after_model_gib=vm_gib(), limits_gib={k: v / 2**30 for k, v in memory_limits(args.device).items()})
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, n=args.n, seed=args.seed)
    print(f"{rows} sequences, cap {args.max_new_tokens}, RLIMIT_AS {args.limit_gb:g} GiB, "
          f"VmSize {report['vm_after_model_gib']:.2f} GiB after the model; generating...", flush=True)
    report.update(run_call(engine, prompts, params, args.time_limit_s))
    report["vm_peak_gib"] = vm_gib("VmPeak")
    cols = [c for c in ("ok", "rows_x_cap_gib", "pool_gib", "pool_blocks", "peak_blocks", "ceiling_blocks", "growths",
                        "preemptions", "tokens", "seconds", "vm_after_model_gib", "vm_peak_gib") if c in report]
    print(table([report], cols))
    if report["ok"] is False:
        print("error:", report["error"])
    write_json(args.out, report)
    if report["ok"] == "running":
        os._exit(0)  # the call's thread is still decoding: leave without waiting for it
    return report


if __name__ == "__main__":
    main()
