"""Float32 few-row products on the CPU: torch's layout (F.linear, `x @ W^T`) against the engine's weight-major one
(`W @ x^T`, rollout/runtime/model/linear.py), side by side in one process.

  * products: every linear of the model's decoder layers and its LM head, each weight a separate tensor read
    from memory as a decode step reads them (the model's own weights), at each row count of --rows: ms per pass
    over all of them in each layout, the weight GB/s, and the ratio;
  * steps: the engine's plain float32 decode step through the public API (`generate`, EOS ignored) at each
    --batch-sizes, with its Linears as they are and with F.linear alone (`unpack_linears`); arms alternated.

    python -m rlspec.bench linear                       # the embedded model, ~5 min on 2 cores
"""
from __future__ import annotations

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, math_prompts, smoke_model
from rlspec.bench.step import engine_step_ms

NAME = "linear"
HELP = "float32 few-row products: F.linear vs the engine's weight-major layout, per row count and per decode step"


def add_arguments(p) -> None:
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed call")


def product_rows(model, rows: list[int], reps: int) -> list[dict]:
    """ms of one pass of x through every linear of `model` (decoder layers + LM head) in each layout."""
    import torch
    import torch.nn.functional as F

    from rlspec.rollout.runtime.model.linear import Linear, weight_major_linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    widest = max(m.in_features for m in layers)

    def one_pass(fn, x):
        def run(_rep):
            with torch.inference_mode():
                return harness.timed(lambda: [fn(x[:, :m.in_features], m.weight, m.bias) for m in layers])[1] * 1e3
        return run

    out = []
    for n in rows:
        x = torch.randn(n, widest)
        arms = {"f_linear": one_pass(F.linear, x), "weight_major": one_pass(weight_major_linear, x)}
        for arm in arms.values():
            arm(-1)  # warm: MKL's buffers, the allocator
        runs = harness.alternate(arms, reps)
        med = harness.medians(runs)
        out.append({"rows": n, "f_linear_ms": med["f_linear"], "weight_major_ms": med["weight_major"],
                    "f_linear_gbs": nbytes / med["f_linear"] / 1e6,
                    "weight_major_gbs": nbytes / med["weight_major"] / 1e6,
                    "speedup": harness.medians(harness.ratios(runs, "weight_major"))["f_linear"], "runs": runs})
        print(f"[linear] {n} rows: F.linear {med['f_linear']:.1f} ms, weight-major {med['weight_major']:.1f} ms",
              flush=True)
    return out


def step_rows(path: str, batch_sizes: list[int], steps: int, reps: int) -> list[dict]:
    """The engine's float32 decode step with its Linears as they are and with F.linear alone."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model.linear import unpack_linears

    engines = {arm: RolloutEngine.from_pretrained(path, dtype="float32", max_num_seqs=max(batch_sizes))
               for arm in ("engine", "f_linear")}
    unpack_linears(engines["f_linear"].model)
    prompts = math_prompts(engines["engine"].tokenizer, max(batch_sizes), seed=3)
    out = []
    for b in batch_sizes:
        arms = {arm: (lambda eng: lambda _rep: engine_step_ms(eng, prompts[:b], steps))(eng)
                for arm, eng in engines.items()}
        for arm in arms.values():
            arm(-1)
        runs = harness.alternate(arms, reps, lambda a, rep, v: print(f"[linear] batch {b} rep {rep} {a}: {v:.1f} ms",
                                                                     flush=True))
        med = harness.medians(runs)
        out.append({"batch": b, "f_linear_step_ms": med["f_linear"], "engine_step_ms": med["engine"],
                    "speedup": harness.medians(harness.ratios(runs, "engine"))["f_linear"], "runs": runs})
    return out


def run(args) -> dict:
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.runtime.model.fetch import fetch_model

    if args.smoke:
        args.model, args.rows, args.batch_sizes, args.steps = smoke_model(args.model, args.out), [1, 8], [8], 2
    args.reps = max(args.reps, 1)
    path = fetch_model(args.model)
    products = product_rows(loader.load_model(path, dtype="float32"), args.rows, args.reps)
    steps = step_rows(path, args.batch_sizes, args.steps, args.reps)
    print(harness.table(steps, ["batch", "f_linear_step_ms", "engine_step_ms", "speedup"]))
    return {"rows": products, "steps": steps,
            "columns": ["rows", "f_linear_ms", "weight_major_ms", "f_linear_gbs", "weight_major_gbs", "speedup"]}
