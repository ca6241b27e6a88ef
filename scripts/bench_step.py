"""Where one decode step stands against this machine's limits (issue 27's table), measured side by side.

In one process, on the embedded model (bf16 by default):
  * memory bandwidth: torch's sum over a 1 GiB tensor (best of 5), and the roofline of a batch-1 step:
    the bytes of the weights a step reads (every layer + the LM head) / bandwidth;
  * transformers' bare forward of one token over a DynamicCache (no sampling), batch 1 and 8;
  * the engine's plain decode step through the public API (`generate`, EOS ignored): the step time is
    (t(N tokens) - t(1 token)) / (N - 1), so prefill and call set-up cancel; three arms alternated over
    --reps repetitions (median), compilation done before timing: `unpacked` (eager, F.linear: the engine
    before model/linear.py), `packed` (eager on packed oneDNN weights, compile_mode="off"), `compiled`
    (compile_mode="auto" with the fused step switched off: the engine of session 16) and `fused` (the engine:
    compile_mode="auto", each layer one C++ op, rollout/runtime/model/fused.py);
  * verify steps at batch 1 (T = 1, the plain step, and 2, 4, 8 tokens: a chain of T-1 drafts), timed at the
    step runner over contexts of --verify-ctx tokens: `fused` (the engine), `compiled` (steps of up to 16 tokens
    compiled, products and attention through the bf16 kernels of rollout/runtime/model/kernels),
    `inductor-attention` (compiled, attending through inductor's fused gather/softmax: before the paged-attention
    kernel) and `eager-verify` (the engine before the product kernel: only one-token steps compiled);
  * what a drafted token costs per proposer (ngram, suffix, eagle3) as a share of a plain step: the engine's
    own `rollout/draft_cost/<drafter>` over a batch-1 rollout with the drafter forced on every step.
Writes bench_out/step.json (and prints the tables).

    python scripts/bench_step.py                    # step times: ~5 min on 2 cores once compiled
"""
from __future__ import annotations

import contextlib
import statistics
import time

from common import math_prompts, parser, table, write_json
from bench_engine import hf_model
from longtail import eager_verify


def bandwidth_gbs(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes read per second by torch.sum over `gib` GiB of float32 (best of `reps`): the roofline's rate."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = min(_seconds(lambda: x.sum()) for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_bytes(model) -> int:
    """Weight bytes a decode step reads: every parameter except the input embedding table (one row
    read), the LM head counted once even when tied to it."""
    seen, total = set(), 0
    emb = model.model.embed_tokens.weight
    for p in model.parameters():
        if p.data_ptr() in seen or (p is emb and not model.cfg.tie_word_embeddings):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def hf_step_ms(path: str, dtype, batch: int, ctx: int, steps: int) -> float:
    """transformers' forward of one new token per row over a cache of ctx tokens, ms per step."""
    import torch
    from transformers import DynamicCache

    _, model = hf_model(path, dtype)
    ids = torch.randint(100, 1000, (batch, ctx))
    with torch.inference_mode():
        cache = DynamicCache()
        model(ids, past_key_values=cache, use_cache=True)
        tok = ids[:, -1:]
        for _ in range(2):  # warm-up
            model(tok, past_key_values=cache, use_cache=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            model(tok, past_key_values=cache, use_cache=True)
        return (time.perf_counter() - t0) / steps * 1e3


def engine_step_ms(engine, prompts: list[list[int]], steps: int) -> float:
    """Plain decode step of `engine` by the public API, ms: (t(steps + 1) - t(1)) / steps."""
    from rollout.types import SamplingParams

    def call(n):
        params = SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=0)
        return _seconds(lambda: engine.generate(prompts, params))

    return (call(steps + 1) - call(1)) / steps * 1e3


def unpacked(engine):
    """`engine` with its packed weights dropped: the eager step as it was before model/linear.py."""
    from rollout.runtime.model.linear import unpack_linears

    unpack_linears(engine.model)
    return engine


ARMS = ("unpacked", "packed", "compiled", "fused")  # eager F.linear; eager on packed weights; compiled; the engine


@contextlib.contextmanager
def fused_steps(on: bool):
    """While an arm's steps run: fused steps (model/fused.py) on or off; off, the engine compiles them."""
    from rollout.runtime.model import fused

    saved = fused.enabled
    fused.enabled = on
    try:
        yield
    finally:
        fused.enabled = saved


def measure_steps(args) -> list[dict]:
    import torch

    from rollout.engine import RolloutEngine
    from rollout.runtime.model.fetch import fetch_model

    path = fetch_model(args.model)
    dtype = getattr(torch, args.dtype)

    def build(mode):
        return RolloutEngine.from_pretrained(path, dtype=args.dtype, max_num_seqs=max(args.batch_sizes), compile_mode=mode)

    engines = {"unpacked": unpacked(build("off")), "packed": build("off"), "compiled": build("auto"),
               "fused": build("auto")}
    prompts = math_prompts(engines["packed"].tokenizer, max(args.batch_sizes), seed=3)
    rows = []
    for b in args.batch_sizes:
        ps = prompts[:b]
        for arm, eng in engines.items():  # compile (and warm) every shape this batch size meets
            t0 = time.perf_counter()
            with fused_steps(arm == "fused"):
                engine_step_ms(eng, ps, 4)
            print(f"[step] batch {b} {arm}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        runs = {arm: [] for arm in (*ARMS, "transformers")}
        for rep in range(args.reps):
            for arm, eng in engines.items():
                with fused_steps(arm == "fused"):
                    runs[arm].append(engine_step_ms(eng, ps, args.steps))
            runs["transformers"].append(hf_step_ms(path, dtype, b, args.ctx, args.steps))
            print(f"[step] batch {b} rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in runs.items()), flush=True)
        rows.append({"batch": b, **{f"{k}_ms": statistics.median(v) for k, v in runs.items()}, "runs": runs})
    return rows, step_bytes(engines["packed"].model)


VERIFY_ARMS = ("fused", "compiled", "inductor-attention", "eager-verify")


@contextlib.contextmanager
def verify_arm(arm: str):
    """While an arm's steps run: fused steps only for `fused`; `inductor-attention` attends through inductor's
    fused gather/softmax (the engine before the paged-attention kernel; dynamo keeps both graphs, guarded on the
    switch)."""
    from rollout.runtime.model import kernels

    saved = kernels.attention
    kernels.attention = arm != "inductor-attention"
    try:
        with fused_steps(arm == "fused"):
            yield
    finally:
        kernels.attention = saved


def verify_rows(args) -> list[dict]:
    """Batch-1 step time at T tokens per row and each --verify-ctx context, ms: `compiled` (the engine),
    `inductor-attention` (the same without the paged-attention kernel) and `eager-verify` (only one-token steps
    compiled, the engine before the verify kernel)."""
    import torch

    from rollout.engine import RolloutEngine
    from rollout.runtime.model.fetch import fetch_model

    path = fetch_model(args.model)
    arms = {}
    top = max(args.verify_ctx)
    for arm in VERIFY_ARMS:
        eng = RolloutEngine.from_pretrained(path, dtype=args.dtype, max_num_seqs=1, compile_mode="auto")
        runner = eng.runner
        with eager_verify() if arm == "eager-verify" else contextlib.nullcontext():  # the step runner is built here
            cache = runner.ensure_cache(1, top + 64)
        cache.grow([(0, "bench", top + 32)])
        arms[arm] = runner
    rows = []
    for ctx in args.verify_ctx:
        start = torch.tensor([ctx])
        for T in (1, *args.verify_tokens):
            tokens = torch.randint(100, 1000, (1, T), generator=torch.Generator().manual_seed(T))
            runs = {arm: [] for arm in arms}
            for arm, runner in arms.items():
                with verify_arm(arm):
                    for _ in range(3):  # compile and warm
                        runner.step(tokens, start)
            for _ in range(args.reps):
                for arm, runner in arms.items():
                    with verify_arm(arm):
                        t0 = time.perf_counter()
                        for _ in range(args.steps):
                            runner.step(tokens, start)
                    runs[arm].append((time.perf_counter() - t0) / args.steps * 1e3)
            row = {"ctx": ctx, "tokens": T, **{f"{a}_ms": statistics.median(v) for a, v in runs.items()},
                   "runs": runs, "counts": {a: dict(r.steps.counts) for a, r in arms.items()}}
            rows.append(row)
            print(f"[step] verify ctx {ctx} T={T}: " + ", ".join(f"{a} {row[f'{a}_ms']:.2f} ms" for a in arms),
                  flush=True)
    for r in rows:
        base = next(b for b in rows if b["ctx"] == r["ctx"] and b["tokens"] == 1)
        for a in arms:
            r[f"{a}_vs_plain"] = r[f"{a}_ms"] / base[f"{a}_ms"]  # against the same arm's plain step
    return rows


def draft_costs(args) -> list[dict]:
    """Each proposer's time per drafted token as a share of a plain step (the engine's rollout/draft_cost)."""
    from rollout import metrics as M
    from rollout.engine import RolloutEngine
    from rollout.runtime.model.fetch import fetch_model
    from rollout.types import SamplingParams, SpecConfig

    path = fetch_model(args.model)
    rows = []
    for drafter in args.drafters:
        spec = SpecConfig(drafter=drafter, num_draft_tokens=4, selector="always", online_training=False)
        eng = RolloutEngine.from_pretrained(path, spec=spec, dtype=args.dtype, max_num_seqs=1)
        prompts = math_prompts(eng.tokenizer, 2, seed=5)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.draft_tokens, seed=0)
        eng.generate(prompts[:1], params)  # warm-up; the suffix index learns from it
        eng.stats()
        eng.generate(prompts[1:], params)
        s = eng.stats()
        rows.append({"drafter": drafter, "plain_step_ms": s.get(M.PLAIN_STEP_MS),
                     "draft_ms_per_token": s.get(f"{M.DRAFT_MS_PER_TOKEN}/{drafter}"),
                     "draft_cost": s.get(f"{M.DRAFT_COST}/{drafter}"), "accept_len": s.get(M.ACCEPT_LEN)})
        eng.close()
        print(f"[step] draft cost {drafter}: {rows[-1]}", flush=True)
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=48, help="decode steps per timed call")
    ap.add_argument("--ctx", type=int, default=64, help="transformers' cache length (the prompts' order)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--verify-tokens", type=int, nargs="*", default=[2, 4, 8], help="verify rows' T (none: skip)")
    ap.add_argument("--verify-ctx", type=int, nargs="+", default=[200, 1000],
                    help="contexts the verify rows' steps attend over")
    ap.add_argument("--drafters", nargs="*", default=["ngram", "suffix", "eagle3"], help="draft-cost rows (none: skip)")
    ap.add_argument("--draft-tokens", type=int, default=128, help="tokens of the draft-cost rollout")
    ap.add_argument("--skip-plain", action="store_true", help="only the verify and draft-cost rows")
    ap.add_argument("--out", default="bench_out/step.json")
    args = ap.parse_args()
    bw = bandwidth_gbs()
    rows, nbytes = measure_steps(args) if not args.skip_plain else ([], None)
    verify = verify_rows(args) if args.verify_tokens else []
    costs = draft_costs(args) if args.drafters else []
    for c in costs:  # a drafter forced on every step leaves no plain step of its own: use the verify rows' one
        if c["draft_cost"] is None and c["draft_ms_per_token"] is not None and verify:
            c["plain_step_ms"] = verify[0]["fused_ms"]
            c["draft_cost"] = c["draft_ms_per_token"] / c["plain_step_ms"]
    if nbytes is None:
        from rollout.runtime.model import loader
        from rollout.runtime.model.fetch import fetch_model

        nbytes = step_bytes(loader.load_model(fetch_model(args.model), dtype=args.dtype))
    roofline_ms = nbytes / (bw * 1e9) * 1e3
    for r in rows:  # the engine's step is the fused arm's
        r["roofline_ms"] = roofline_ms if r["batch"] == 1 else None
        r["fused_vs_roofline"] = r["fused_ms"] / roofline_ms if r["batch"] == 1 else None
        r["fused_vs_transformers"] = r["fused_ms"] / r["transformers_ms"]
        r["fused_vs_compiled"] = r["fused_ms"] / r["compiled_ms"]
        r["fused_vs_unpacked"] = r["fused_ms"] / r["unpacked_ms"]
    print(f"bandwidth {bw:.1f} GB/s, step weights {nbytes / 1e6:.0f} MB, batch-1 roofline {roofline_ms:.2f} ms")
    if rows:
        print(table(rows, ["batch", "roofline_ms", "transformers_ms", "unpacked_ms", "packed_ms", "compiled_ms",
                           "fused_ms", "fused_vs_roofline", "fused_vs_transformers", "fused_vs_compiled"]))
    if verify:
        print(table(verify, ["ctx", "tokens", *(f"{a}_ms" for a in VERIFY_ARMS),
                             *(f"{a}_vs_plain" for a in VERIFY_ARMS)]))
    if costs:
        print(table(costs, ["drafter", "plain_step_ms", "draft_ms_per_token", "draft_cost", "accept_len"]))
    write_json(args.out, {"config": vars(args), "bandwidth_gbs": bw, "step_weight_bytes": nbytes,
                          "roofline_ms": roofline_ms, "steps": rows, "verify_steps": verify, "draft_costs": costs})


if __name__ == "__main__":
    main()
