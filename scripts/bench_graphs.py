"""Decode step time with and without CUDA graphs (rollout/runtime/graphs.py), and the graph pool's memory.

For each model (the embedded SmolLM2-135M, and a random-weight Llama shaped like Llama-3.2-1B) and
batch size, time plain decode steps (T = 1) at a fixed context through EagerRunner and through a
lazy GraphPool (its first call, which captures, is timed separately). Step times include the host
work each path does per step (padding, input copies, output clone). Prints a table and writes JSON:
{cuda, device, torch, config, results: [{model, batch, eager_ms, graph_ms, speedup, capture_s}],
 pools: {model: {graphs, memory_mib, static_mib}}, skipped: {model: reason}}.

    python scripts/bench_graphs.py --batch-sizes 1 4 32 --context 500 --out bench_out/graphs.json

Without CUDA it prints that and writes {"cuda": false, ...} (exit 0). --smoke runs a tiny random
model for a few steps anywhere (on CPU through the pool's emulated replay) to test this script.
"""
from __future__ import annotations

import argparse
import sys
import time

from common import parser, write_json  # first: it puts the repo on sys.path
from bench_engine import SMOLLM2_135M, TINY, release_cached, sync, time_steps

import torch

from rollout.runtime.graphs import EagerRunner, GraphPool
from rollout.runtime.kv_cache import PagedKVCache
from rollout.runtime.model import loader

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-1b-random"],
                   help="smollm2-135m (embedded, via fetch_model), llama-1b-random, tiny-random")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 32], help="live rows per decode step")
    p.add_argument("--context", type=int, default=500, help="cache entries each row already holds")
    p.add_argument("--cache-length", type=int, default=2048, help="positions per cache row (max_model_len)")
    p.add_argument("--iters", type=int, default=50, help="timed steps per measurement")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 5 steps, runs on CPU too")
    p.add_argument("--out", default="bench_out/graphs.json", help="where to write the JSON results")
    return p.parse_args(argv)


def random_llama(shape: dict, dtype: torch.dtype, device) -> torch.nn.Module:
    """Our runtime with random weights (std 0.02, norms 1), built straight on the device."""
    from transformers import LlamaConfig

    model = loader.build_model(LlamaConfig(**shape), dtype, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


def load(name: str, dtype: torch.dtype, device):
    if name == "smollm2-135m":
        from rollout.runtime.model.fetch import fetch_model

        try:
            return loader.load_model(fetch_model("smollm2-135m-instruct"), dtype=dtype, device=device)
        except Exception as exc:  # no network and no cached copy: same shape, random weights
            print(f"  smollm2-135m: embedded weights unavailable ({type(exc).__name__}); random weights", flush=True)
            return random_llama(SMOLLM2_135M, dtype, device)
    shapes = {"llama-1b-random": LLAMA_1B, "tiny-random": TINY}
    if name not in shapes:
        raise ValueError(f"unknown model {name!r}; choose from smollm2-135m, {', '.join(shapes)}")
    return random_llama(shapes[name], dtype, device)


def bench_model(name: str, args, device, dtype) -> tuple[list[dict], dict]:
    model = load(name, dtype, device)
    rows = max(args.batch_sizes)
    cache = PagedKVCache.for_rows(model.cfg, rows, args.cache_length, dtype, device)
    model.init_rope(args.cache_length)
    eager = EagerRunner(model, cache, device)
    backend = "cuda" if device.type == "cuda" else "emulate"
    pool = GraphPool(model, cache, device, "lazy", max_t=1, backend=backend)
    gen = torch.Generator().manual_seed(0)
    results = []
    for B in args.batch_sizes:
        tokens = torch.randint(0, model.cfg.vocab_size, (B, 1), generator=gen)
        start = torch.full((B,), args.context, dtype=torch.long)
        t0 = time.perf_counter()
        pool.run(tokens, start)  # captures (b, 1)
        sync(device)
        capture_s = time.perf_counter() - t0
        eager_s = time_steps(eager.run, tokens, start, args.iters, device, warmup=3)
        graph_s = time_steps(pool.run, tokens, start, args.iters, device, warmup=3)
        row = dict(model=name, batch=B, eager_ms=eager_s * 1e3, graph_ms=graph_s * 1e3,
                   speedup=eager_s / graph_s, capture_s=capture_s)
        print(f"  {name} batch {B}: eager {row['eager_ms']:.3f} ms, graph {row['graph_ms']:.3f} ms, "
              f"x{row['speedup']:.2f} (capture {capture_s:.2f} s)", flush=True)
        results.append(row)
    info = dict(graphs=len(pool.graphs), memory_mib=pool.memory_bytes() / 2**20,
                static_mib=pool.static.nbytes() / 2**20,
                kv_cache_mib=cache.nbytes() / 2**20)
    del pool, eager, cache, model
    release_cached(device)
    return results, info


def print_table(results: list[dict], pools: dict, skipped: dict) -> None:
    print(f"\n{'model':<18}{'batch':>6}{'eager ms':>11}{'graph ms':>11}{'speedup':>9}")
    for r in results:
        print(f"{r['model']:<18}{r['batch']:>6}{r['eager_ms']:>11.3f}{r['graph_ms']:>11.3f}{r['speedup']:>8.2f}x")
    for name, p in pools.items():
        print(f"{name}: {p['graphs']} graphs, pool {p['memory_mib']:.1f} MiB (static buffers "
              f"{p['static_mib']:.1f} MiB), KV cache {p['kv_cache_mib']:.0f} MiB")
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.smoke:
        args.models, args.batch_sizes, args.iters, args.context, args.cache_length = (
            ["tiny-random"], [1, 3], 5, 20, 64)
    elif not cuda:
        print("CUDA is unavailable: CUDA graphs cannot be measured on this machine (nothing to do).")
        write_json(args.out, {"cuda": False, "reason": "torch.cuda.is_available() is False",
                              "torch": torch.__version__})
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    dtype = loader.resolve_dtype(args.dtype)
    results, pools, skipped = [], {}, {}
    for name in args.models:
        print(f"{name}: loading", flush=True)
        try:
            rows, pools[name] = bench_model(name, args, device, dtype)
            results += rows
        except Exception as exc:  # e.g. no network to fetch SmolLM2's wheel: record it, go on
            skipped[name] = f"{type(exc).__name__}: {exc}"
    print_table(results, pools, skipped)
    write_json(args.out, dict(cuda=cuda, device=torch.cuda.get_device_name() if cuda else "cpu (emulated replay)",
                              torch=torch.__version__, config=vars(args), results=results, pools=pools,
                              skipped=skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
