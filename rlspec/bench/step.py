"""Where one decode step stands against this machine's limits, measured side by side in one process.

  * memory bandwidth: torch's sum over a 1 GiB tensor (best of 5), and the roofline of a batch-1 step: the bytes
    of the weights a step reads (every layer + the LM head) / bandwidth;
  * transformers' bare forward of one token over a DynamicCache (no sampling), at each batch size;
  * the engine's plain decode step through the public API (`generate`, EOS ignored): (t(N+1 tokens) - t(1)) / N,
    so prefill and call set-up cancel; arms alternated over --reps repetitions (medians), compiled first:
    `unpacked` (eager F.linear), `packed` (eager on packed oneDNN weights, compile_mode="off"), `compiled`
    (compile_mode="auto", fused steps off) and `fused` (the engine: each layer one C++ op);
  * verify steps at batch 1 (T = 2, 4, 8 tokens) per arm and the cost of a drafted token per proposer
    (rlspec/bench/step_verify.py).

    python -m rlspec.bench step                                  # ~5 min on 2 cores once compiled
    python -m rlspec.bench step --skip-plain --verify-tokens 2 4 8 16 --drafters eagle3
"""
from __future__ import annotations

import time

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, SMOKE_DTYPE, hf_model, math_prompts, smoke_model
from rlspec.bench.step_verify import VERIFY_ARMS, draft_costs, fused_steps, verify_rows

NAME = "step"
HELP = "one decode step (plain and verify) vs the bandwidth roofline and transformers; draft cost per proposer"
ARMS = ("unpacked", "packed", "compiled", "fused")


def add_arguments(p) -> None:
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=48, help="decode steps per timed call")
    p.add_argument("--ctx", type=int, default=64, help="transformers' cache length (the prompts' order)")
    p.add_argument("--verify-tokens", type=int, nargs="*", default=[2, 4, 8], help="verify rows' T (none: skip)")
    p.add_argument("--verify-ctx", type=int, nargs="+", default=[200, 1000], help="contexts of the verify rows")
    p.add_argument("--drafters", nargs="*", default=["ngram", "suffix", "eagle3"], help="draft-cost rows (none: skip)")
    p.add_argument("--draft-tokens", type=int, default=128, help="tokens of the draft-cost rollout")
    p.add_argument("--skip-plain", action="store_true", help="only the verify and draft-cost rows")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the bandwidth probe's tensor")


def bandwidth_gbs(gib: float, reps: int = 5) -> float:
    """Bytes read per second by torch.sum over `gib` GiB of float32 (best of `reps`): the roofline's rate."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    return x.numel() * 4 / min(harness.timed(x.sum)[1] for _ in range(reps)) / 1e9


def step_bytes(model) -> int:
    """Weight bytes a decode step reads: every parameter except the input embedding table (one row read), the LM
    head counted once even when tied to it."""
    seen, total = set(), 0
    emb = model.model.embed_tokens.weight
    for p in model.parameters():
        if p.data_ptr() in seen or (p is emb and not model.cfg.tie_word_embeddings):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def hf_step_ms(model, batch: int, ctx: int, steps: int) -> float:
    """transformers' forward of one new token per row over a cache of ctx tokens, ms per step."""
    import torch
    from transformers import DynamicCache

    from rlspec.rollout.runtime.model.loader import hf_cache_arg

    ids = torch.randint(100, 1000, (batch, ctx))
    with torch.inference_mode():
        cache = {hf_cache_arg(model): DynamicCache()}
        model(ids, **cache, use_cache=True)
        tok = ids[:, -1:]
        for _ in range(2):  # warm-up
            model(tok, **cache, use_cache=True)
        return harness.timed(lambda: [model(tok, **cache, use_cache=True) for _ in range(steps)])[1] / steps * 1e3


def engine_step_ms(engine, prompts, steps: int) -> float:
    """Plain decode step of `engine` by the public API, ms: (t(steps + 1) - t(1)) / steps."""
    from rlspec.rollout.types import SamplingParams

    def call(n):
        params = SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=0)
        return harness.timed(lambda: engine.generate(prompts, params))[1]

    return (call(steps + 1) - call(1)) / steps * 1e3


def plain_rows(args) -> tuple[list[dict], int]:
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.rollout.runtime.model.linear import unpack_linears

    path = fetch_model(args.model)

    def build(mode):
        return RolloutEngine.from_pretrained(path, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
                                             compile_mode=mode)

    engines = {"unpacked": build("off"), "packed": build("off"), "compiled": build("auto"), "fused": build("auto")}
    unpack_linears(engines["unpacked"].model)  # the eager step before packed weights
    _, hf = hf_model(path, args.dtype)
    prompts = math_prompts(engines["packed"].tokenizer, max(args.batch_sizes), seed=3)
    rows = []
    for b in args.batch_sizes:
        ps = prompts[:b]
        for arm, eng in engines.items():  # compile (and warm) every shape this batch size meets
            t0 = time.perf_counter()
            with fused_steps(arm == "fused"):
                engine_step_ms(eng, ps, 2)
            print(f"[step] batch {b} {arm}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)

        def arm_fn(arm):
            def once(rep):
                if arm == "transformers":
                    return hf_step_ms(hf, b, args.ctx, args.steps)
                with fused_steps(arm == "fused"):
                    return engine_step_ms(engines[arm], ps, args.steps)
            return once

        runs = harness.alternate({a: arm_fn(a) for a in (*ARMS, "transformers")}, args.reps,
                                 lambda a, rep, v: print(f"[step] batch {b} rep {rep} {a}: {v:.2f} ms", flush=True))
        rows.append({"batch": b, **{f"{k}_ms": v for k, v in harness.medians(runs).items()}, "runs": runs})
    return rows, step_bytes(engines["packed"].model)


def run(args) -> dict:
    if args.smoke:
        args.dtype, args.batch_sizes, args.steps, args.ctx, args.reps = SMOKE_DTYPE, [1], 2, 8, 1
        args.verify_tokens, args.verify_ctx, args.drafters, args.draft_tokens = [2], [16], ["ngram"], 6
        args.bandwidth_gib, args.model = 1 / 64, smoke_model(args.model, args.out)
    bw = bandwidth_gbs(args.bandwidth_gib)
    rows, nbytes = plain_rows(args) if not args.skip_plain else ([], None)
    verify = verify_rows(args) if args.verify_tokens else []
    costs = draft_costs(args) if args.drafters else []
    for c in costs:  # a drafter forced on every step leaves no plain step of its own: use the verify rows' one
        if c["draft_cost"] is None and c["draft_ms_per_token"] is not None and verify:
            c["plain_step_ms"] = verify[0]["fused_ms"]
            c["draft_cost"] = c["draft_ms_per_token"] / c["plain_step_ms"]
    if nbytes is None:
        from rlspec.rollout.runtime.model import loader
        from rlspec.rollout.runtime.model.fetch import fetch_model

        nbytes = step_bytes(loader.load_model(fetch_model(args.model), dtype=args.dtype))
    roofline_ms = nbytes / (bw * 1e9) * 1e3
    for r in rows:  # the engine's step is the fused arm's
        r["roofline_ms"] = roofline_ms if r["batch"] == 1 else None
        r["fused_vs_roofline"] = r["fused_ms"] / roofline_ms if r["batch"] == 1 else None
        r["fused_vs_transformers"] = r["fused_ms"] / r["transformers_ms"]
        r["fused_vs_unpacked"] = r["fused_ms"] / r["unpacked_ms"]
    print(f"bandwidth {bw:.1f} GB/s, step weights {nbytes / 1e6:.0f} MB, batch-1 roofline {roofline_ms:.2f} ms")
    if verify:
        print(harness.table(verify, ["ctx", "tokens", *(f"{a}_ms" for a in VERIFY_ARMS),
                                     *(f"{a}_vs_plain" for a in VERIFY_ARMS)]))
    if costs:
        print(harness.table(costs, ["drafter", "plain_step_ms", "draft_ms_per_token", "draft_cost", "accept_len"]))
    return {"bandwidth_gbs": bw, "step_weight_bytes": nbytes, "roofline_ms": roofline_ms, "rows": rows,
            "verify_steps": verify, "draft_costs": costs,
            "columns": ["batch", "roofline_ms", "transformers_ms", "unpacked_ms", "packed_ms", "compiled_ms",
                        "fused_ms", "fused_vs_roofline", "fused_vs_transformers"]}
