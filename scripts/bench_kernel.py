"""How fast the CPU few-row kernel streams a whole model's weights, by weight layout (rollout/runtime/model/kernels).

One process, the embedded model's products (SmolLM2-135M: per layer q/k/v fused, o, gate/up fused, down; the LM
head) as random bf16 weights, 269 MB in all, more than the caches hold. Per row count (1, 2, 4, 8, 16), arms
alternated over --reps repetitions, each a pass over every weight in model order:
  * `row-major`: rlspec_kernels::small_linear on the weights as modules hold them (session 13's kernel);
  * `blocked`: rlspec_kernels::packed_linear on kernels.pack copies (what compiled steps use now);
  * `reduction` (1 row only): inductor's compiled `(x * W).sum(-1)`, the single-row product of compiled steps
    before the kernel served one row.
Prints GB/s (weight bytes / seconds, median) and the copy bandwidth measured in the same run; writes
bench_out/kernel_stream.json.

    python scripts/bench_kernel.py              # ~2 min on 2 cores
"""
from __future__ import annotations

import statistics
import time

from common import parser, table, write_json

# (out, in) of each product of one SmolLM2-135M layer, and its LM head
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def seconds(fn, iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    import torch

    from rollout.runtime.model import kernels

    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3, help="passes over the weights per timing")
    ap.add_argument("--out", default="bench_out/kernel_stream.json")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("the kernel is not available here (no AVX-512 BF16, or no C++ toolchain)")
    torch.manual_seed(0)
    weights = [torch.randn(o, i).bfloat16() for _ in range(args.layers) for o, i in LAYER]
    weights.append(torch.randn(*HEAD).bfloat16())
    blocked = [kernels.pack(w) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    src = torch.empty(2**30, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / seconds(lambda: dst.copy_(src), 5) / 1e9
    del src, dst
    reduction = torch.compile(lambda x, w: (x[..., None, :].float() * w.float()).sum(-1).to(x.dtype))
    rows = []
    for m in args.rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in {i for _, i in LAYER + [HEAD]}}
        arms = {"row-major": lambda: [kernels.small_linear(xs[w.shape[1]], w) for w in weights],
                "blocked": lambda: [kernels.packed_linear(xs[w.shape[1]], p, None, w.shape[0])
                                    for w, p in zip(weights, blocked)]}
        if m == 1:
            arms["reduction"] = lambda: [reduction(xs[w.shape[1]], w) for w in weights]
        runs = {a: [] for a in arms}
        for _ in range(args.reps):
            for a, fn in arms.items():
                runs[a].append(nbytes / seconds(fn, args.iters) / 1e9)
        rows.append({"rows": m, **{f"{a}_gbs": statistics.median(v) for a, v in runs.items()}, "runs": runs})
        print(f"[kernel] {m} rows: " + ", ".join(f"{a} {statistics.median(v):.1f} GB/s" for a, v in runs.items()),
              flush=True)
    print(f"weights {nbytes / 1e6:.0f} MB, copy bandwidth {copy_gbs:.1f} GB/s")
    print(table(rows, ["rows", "row-major_gbs", "blocked_gbs", "reduction_gbs"]))
    write_json(args.out, {"config": vars(args), "weight_bytes": nbytes, "copy_gbs": copy_gbs, "rows": rows})


if __name__ == "__main__":
    main()
