"""GPU benchmarks of `make gpu-check`: the engine against transformers' `generate` on random-weight models
shaped like SmolLM2-135M and Qwen2.5-7B (Qwen2.5-1.5B on request; bf16, built on the device from a transformers
config: no hub, no download; step time does not depend on the weights' values).

Per model and batch (default 1, 8, 32, 128), with the same prompts, greedy, EOS ignored:
  * tokens/s of HF `generate` and of RolloutEngine.generate (graphs on; captures warmed up first);
  * the decode step at the rollout's mean context, eager and replayed from the CUDA graph pool;
  * achieved memory bandwidth of a graph step: (weights + KV bytes read) / step time, and its fraction
    of the device's bandwidth measured by a 1 GiB device-to-device copy;
  * the KV cache's and the graph pool's memory;
  * what the timed call did besides replays: dynamo compiles, graph captures, eager steps, a new KV pool;
  * with --compile both (the default), the same rows with the compiled decoder layer inside the CUDA graphs
    (compile_mode="on") for the batches in --compile-batches: whether compiling pays on this GPU;
  * the pool sweep (--pool-sweep; none: skip): generate calls of growing lengths at batch 8, the pool handed
    back between them as in training, twice through, with compiled layers by default (--sweep-compile): the
    dynamo compiles and seconds each call spent (a new pool size must not recompile the layer's graphs).
Models that would not fit in free memory, and whatever the --budget-s time bound leaves, are skipped and
say why. Prints a table and writes JSON after every model (a cut-off run keeps what it measured):
{device, torch, transformers, peak_gbs, elapsed_s, config, models: {name: {...}}, results: [...], skipped: {}}.

    PYTHONPATH=. python3 scripts/bench_gpu.py                       # what make gpu-check runs
    PYTHONPATH=. python3 scripts/bench_gpu.py --models qwen2.5-7b --batch-sizes 1 32
    PYTHONPATH=. python3 scripts/bench_gpu.py --smoke               # tiny model, seconds, CPU or GPU
"""
from __future__ import annotations

import argparse
import sys
import time

from common import parser, write_json  # first: it puts the repo on sys.path
from bench_engine import SMOLLM2_135M, TINY, release_cached, sync, time_steps, timed

import torch

from rollout.engine import RolloutEngine
from rollout.runtime.graphs import EagerRunner, GraphPool
from rollout.runtime.runner import compiled_frames
from rollout.types import SamplingParams

# (transformers config class, shape, new tokens per sequence): fewer tokens for the larger models
SHAPES = {
    "smollm2-135m": ("LlamaConfig", SMOLLM2_135M, 128),
    "qwen2.5-1.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                         tie_word_embeddings=True, rope_theta=1000000.0), 64),
    "qwen2.5-7b": ("Qwen2Config", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                       tie_word_embeddings=False, rope_theta=1000000.0), 32),
    "tiny": ("LlamaConfig", TINY, 4),
}
KNOWN_PEAK_GBS = {"H100": 3350.0, "H200": 4800.0}  # datasheet HBM bandwidth (SXM), for reference only


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    # the default fits `make gpu-check` (tests ~2 min + this) in a 15-minute device lease with room for a rerun
    p.add_argument("--models", nargs="*", default=["smollm2-135m", "qwen2.5-7b"],
                   choices=list(SHAPES), help="model shapes to build with random weights")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128], help="sequences per generate")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per (random) prompt")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence (default: per model)")
    p.add_argument("--iters", type=int, default=20, help="timed decode steps per step-time measurement")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting new measurements after this")
    p.add_argument("--compile", default="both", choices=["off", "on", "both"],
                   help="engine arms: graphs of eager layers (off), of compiled layers (on), or both side by side")
    p.add_argument("--compile-batches", type=int, nargs="+", default=[1, 8],
                   help="batches measured with compiled layers (each compiles its own step graph)")
    p.add_argument("--pool-sweep", type=int, nargs="*", default=[96, 224, 480, 992],
                   help="new tokens per call of the pool-size sweep, SmolLM2 shape (none: no sweep)")
    p.add_argument("--sweep-compile", default="on", choices=["off", "on"],
                   help="the pool sweep's compile_mode (on: do compiled graphs serve every pool size?)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV")
    p.add_argument("--smoke", action="store_true", help="tiny model, batches 1 and 2, 4 tokens: runs on CPU too")
    p.add_argument("--out", default="bench_out/gpu_check.json", help="where to write the JSON results")
    return p.parse_args(argv)


def build_hf(name: str, dtype: torch.dtype, device: torch.device):
    """A transformers model of the shape, random weights, built directly in `dtype` on `device`."""
    import transformers

    cls_name, shape, _ = SHAPES[name]
    cfg = getattr(transformers, cls_name)(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no float32 copy of a 7B model on the way
    try:
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    hf.generation_config.eos_token_id = None  # every sequence runs its full length, as in the engine
    return hf.eval()


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every parameter once, the embedding table only when tied
    to the LM head (untied, a step gathers just B of its rows)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or (name.endswith("embed_tokens.weight") and not model.cfg.tie_word_embeddings):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes(model, rows: int, context: int, dtype: torch.dtype) -> int:
    """K and V bytes of `context` positions in `rows` rows over all layers."""
    c = model.cfg
    return 2 * rows * context * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8


def fits(name: str, args, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this model cannot run here (None if it fits): two weight copies (HF's, then ours) + both KV caches."""
    if device.type != "cuda":
        return None
    import transformers

    cls_name, shape, _ = SHAPES[name]
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls_name)(**shape)).parameters())
    c, L = shape, args.prompt_len + new_tokens(name, args) + 32
    kv = 2 * max(args.batch_sizes) * L * c["num_hidden_layers"] * c["num_key_value_heads"] * \
        (c["hidden_size"] // c["num_attention_heads"]) * torch.finfo(dtype).bits // 8
    need = 2 * n * torch.finfo(dtype).bits // 8 + 2 * kv + 4 * 2**30  # + activations, logits, workspaces
    free, _ = torch.cuda.mem_get_info(device)
    return None if need < free else f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"


def new_tokens(name: str, args) -> int:
    return args.new_tokens or SHAPES[name][2]


def measure_peak_gbs(device: torch.device, smoke: bool) -> float:
    """Device-to-device copy bandwidth (read + write) in GB/s: the attainable peak a step is compared with."""
    n = (2**24 if smoke else 2**30)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    iters = 3 if smoke else 20
    t0 = time.perf_counter()
    for _ in range(iters):
        y.copy_(x)
    sync(device)
    return 2 * n * iters / (time.perf_counter() - t0) / 1e9


def bench_hf(hf, prompts, batches, N: int, device) -> dict[int, float]:
    """HF generate tokens/s per batch (greedy, N new tokens each, after one short warm-up call)."""
    def gen(B, n):
        ids = prompts[:B]
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    gen(1, 2)
    return {B: B * N / timed(lambda: gen(B, N), device)[1] for B in batches}


def bench_engine(engine, prompts, batches, N: int, device, args, left) -> list[dict]:
    """Engine tokens/s, step times eager vs graph, bandwidth, per batch; `left()` is the time budget left."""
    greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    full = SamplingParams(temperature=0, max_new_tokens=N, ignore_eos=True)
    # the cache for all rows at the timed length: no timed call meets a new pool size (whose first change
    # recompiles FlexAttention once, with the pool's length dynamic from then on)
    setup_s = timed(lambda: engine.generate(prompts.tolist(), full), device)[1]
    ctx = args.prompt_len + N // 2
    rows = []
    for B in batches:
        if left() <= 0:
            break
        ids = prompts[:B].tolist()
        # captures this batch's graph (compiling its layer first where compiled): the cost met once per shape
        first_s = timed(lambda: engine.generate(ids, greedy), device)[1]
        before = _step_counts(engine)
        secs = timed(lambda: engine.generate(ids, full), device)[1]
        # what the timed call spent besides replays: compiles, captures, eager steps, a new pool
        during = {k: v - before.get(k, 0) for k, v in _step_counts(engine).items()}
        during["new_pool"] = bool(during.pop("pool"))
        # the engine may have replaced its pool (and the graphs over it) during the calls: time the current one
        model, cache = engine.runner.model, engine.runner.cache
        pool = engine.runner.steps if isinstance(engine.runner.steps, GraphPool) else \
            GraphPool(model, cache, device, max_t=1, backend="emulate")  # CPU smoke: the pool's plumbing
        eager = EagerRunner(model, cache, device)
        tokens, start = prompts[:B, :1].cpu(), torch.full((B,), ctx)
        eager_s = time_steps(eager.run, tokens, start, args.iters, device, warmup=2)
        graph_s = time_steps(pool.run, tokens, start, args.iters, device, warmup=2)
        moved = weight_bytes(model) + kv_bytes(model, B, ctx + 1, cache.k.dtype)
        rows.append(dict(batch=B, compile="on" if engine.runner.compiled else "off", engine_tok_s=B * N / secs,
                         step_eager_ms=eager_s * 1e3, step_graph_ms=graph_s * 1e3, first_call_s=first_s,
                         setup_s=setup_s, graph_speedup=eager_s / graph_s, achieved_gbs=moved / graph_s / 1e9,
                         bytes_per_step=moved, timed_call=during))
        print(f"  batch {B}: engine {rows[-1]['engine_tok_s']:.0f} tok/s, step eager {eager_s * 1e3:.2f} ms, "
              f"graph {graph_s * 1e3:.2f} ms, {rows[-1]['achieved_gbs']:.0f} GB/s, first call {first_s:.1f} s; "
              f"timed call: {during}", flush=True)
    return rows


def _step_counts(engine) -> dict[str, int]:
    """Counters of the engine's step runner: dynamo compiles, graph replays/captures/eager steps, and the
    KV pool's identity and generation (a new pool or a grown one drops the graphs over it)."""
    runner = engine.runner
    counts = dict(getattr(runner.steps, "counts", {}))
    counts.update(compiles=compiled_frames(), pool=id(runner.cache), pool_generation=runner.cache.generation)
    return counts


def bench_model(name: str, args, device, dtype, peak_gbs: float, left) -> tuple[list[dict], dict]:
    N = new_tokens(name, args)
    hf = build_hf(name, dtype, device)
    gen = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    prompts = torch.randint(3, vocab, (max(args.batch_sizes), args.prompt_len), generator=gen).to(device)
    print(f"{name}: HF generate", flush=True)
    hf_tok_s = bench_hf(hf, prompts, args.batch_sizes, N, device)
    rows, info = [], {}
    for compiled in [c for c in ("off", "on") if args.compile in (c, "both")]:
        batches = args.batch_sizes if compiled == "off" else [b for b in args.batch_sizes if b in args.compile_batches]
        if left() <= 0 or not batches:
            break
        engine = RolloutEngine.from_hf_model(hf, None, dtype=dtype, device=device,
                                             max_num_seqs=max(args.batch_sizes), max_model_len=args.prompt_len + N + 8,
                                             graph_mode="lazy", free_kv_between_rollouts=False,  # steps timed over it
                                             compile_mode=compiled)
        print(f"{name}: engine, compile {compiled}", flush=True)
        rows += bench_engine(engine, prompts, batches, N, device, args, left)
        steps = engine.runner.steps
        info = dict(params_m=sum(p.numel() for p in engine.model.parameters()) / 1e6,
                    weight_mib=weight_bytes(engine.model) / 2**20, kv_cache_mib=engine.runner.cache.nbytes() / 2**20,
                    graph_pool_mib=steps.memory_bytes() / 2**20, graphs=len(getattr(steps, "graphs", {})),
                    new_tokens=N)
        del engine, steps
        release_cached(device)
    for r in rows:
        r.update(model=name, new_tokens=N, hf_tok_s=hf_tok_s[r["batch"]],
                 speedup_vs_hf=r["engine_tok_s"] / hf_tok_s[r["batch"]], bw_fraction=r["achieved_gbs"] / peak_gbs)
    del hf
    release_cached(device)
    return rows, info


def pool_sweep(lengths: list[int], shape: str, device, dtype, prompt_len: int, compile_mode: str) -> list[dict]:
    """Calls of growing lengths at batch 8, the pool handed back after each as in training,
    twice through: per call its seconds, dynamo compiles and the pool's blocks. The second pass sees
    only sizes met before, so compiles there say that some kernel specialises on a size it had already seen."""
    hf = build_hf(shape, dtype, device)
    prompts = torch.randint(3, hf.config.vocab_size, (8, prompt_len), generator=torch.Generator().manual_seed(1))
    engine = RolloutEngine.from_hf_model(hf, None, dtype=dtype, device=device, max_num_seqs=8,
                                         max_model_len=prompt_len + max(lengths) + 8, graph_mode="lazy",
                                         free_kv_between_rollouts=True, compile_mode=compile_mode)
    del hf
    out = []
    for rep in range(2):
        for n in lengths:
            before = compiled_frames()
            secs = timed(lambda: engine.generate(prompts.tolist(), SamplingParams(temperature=0, max_new_tokens=n,
                                                                                  ignore_eos=True)), device)[1]
            pool = engine.stats().get("rollout/kv_blocks_total")
            out.append(dict(rep=rep, new_tokens=n, seconds=secs, compiles=compiled_frames() - before,
                            pool_blocks=pool))
            print(f"  pool sweep {rep}: {n} tokens, {secs:.2f} s, {out[-1]['compiles']} compiles, pool {pool}",
                  flush=True)
    del engine
    release_cached(device)
    return out


def print_table(results: list[dict], models: dict, skipped: dict, peak_gbs: float) -> None:
    print(f"\npeak (measured copy) {peak_gbs:.0f} GB/s")
    head = ["model", "compiled", "batch", "HF tok/s", "eng tok/s", "x HF", "eager ms", "graph ms", "x graph", "GB/s",
            "% peak"]
    print("".join(f"{h:>11}" if i else f"{h:<14}" for i, h in enumerate(head)))
    for r in results:
        vals = [r["compile"], r["batch"], f"{r['hf_tok_s']:.0f}", f"{r['engine_tok_s']:.0f}",
                f"{r['speedup_vs_hf']:.2f}",
                f"{r['step_eager_ms']:.2f}", f"{r['step_graph_ms']:.2f}", f"{r['graph_speedup']:.2f}",
                f"{r['achieved_gbs']:.0f}", f"{100 * r['bw_fraction']:.0f}"]
        print(f"{r['model']:<14}" + "".join(f"{v:>11}" for v in vals))
    for name, m in models.items():
        print(f"{name}: {m['params_m']:.0f}M params, weights {m['weight_mib']:.0f} MiB, KV cache "
              f"{m['kv_cache_mib']:.0f} MiB, graph pool {m['graph_pool_mib']:.0f} MiB ({m['graphs']} graphs)")
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.smoke:
        args.models, args.batch_sizes, args.prompt_len, args.iters = ["tiny"], [1, 2], 8, 3
        args.compile_batches = [1]  # one compiled step graph: the arm's plumbing, in seconds
        args.pool_sweep, args.sweep_compile = [4, 8], "off"
    elif not cuda:
        print("CUDA is unavailable: run with --smoke on a machine without a GPU.")
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" and not (args.smoke and not cuda) else torch.float32
    import transformers

    t0 = time.perf_counter()
    peak = measure_peak_gbs(device, args.smoke)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    payload = dict(device=name, torch=torch.__version__, transformers=transformers.__version__, peak_gbs=peak,
                   datasheet_gbs=next((v for k, v in KNOWN_PEAK_GBS.items() if k in name), None),
                   config=vars(args), models={}, results=[], skipped={})
    for model in args.models:
        left = lambda: args.budget_s - (time.perf_counter() - t0)  # noqa: E731
        why = "time budget spent" if left() <= 0 else fits(model, args, dtype, device)
        if why:
            payload["skipped"][model] = why
            continue
        rows, payload["models"][model] = bench_model(model, args, device, dtype, peak, left)
        payload["results"] += rows
        payload["elapsed_s"] = time.perf_counter() - t0
        write_json(args.out, payload)
    if args.pool_sweep:
        payload["pool_sweep"] = pool_sweep(args.pool_sweep, args.models[0] if args.smoke else "smollm2-135m",
                                           device, dtype, args.prompt_len, args.sweep_compile)
    payload["elapsed_s"] = time.perf_counter() - t0
    print_table(payload["results"], payload["models"], payload["skipped"], peak)
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
