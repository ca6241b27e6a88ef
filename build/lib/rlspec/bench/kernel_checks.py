"""What the C++ ops' argument checks cost against a decode step (`python -m rlspec.bench kernel-checks`).

Every op of rollout/runtime/model/kernels checks shapes, dtypes and index ranges before it touches memory (ops.h).
A small extension linked against the loaded kernels calls the ops' own check functions (check_layer with its
check_paged, check_head, check_sample, check_verify) in a C++ loop on a step's arguments, so a call's time is the
checks' alone; for decoder_layer it adds the checks of the four packed_linear calls the layer makes inside.
SmolLM2-135M's shapes (30 layers, random weights), a context of --ctx positions. The step (30 decoder_layer calls,
final_head, sample_rows; batch 1 and 8) is timed in the same process (median of --reps), and the checks' share of
it reported. About a minute the first time (it builds the timing extension), then ~20 s.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

NAME = "kernel-checks"
HELP = "the C++ ops' argument checks: ns a call, and their share of a CPU decode step"

LAYERS, H, HEADS, KV, D, INTER, VOCAB, BS = 30, 576, 9, 3, 64, 1536, 49152, 16

BENCH = r"""
#include "ops.h"
#include <chrono>
using namespace rlspec_kernels;

template <typename F> double ns_per_call(int64_t n, const F& f) {
  f();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; i++) f();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
}

// decoder_layer's checks, then those of the packed_linear calls it makes (its attention is checked by check_layer)
double layer_checks(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k, at::Tensor v, at::Tensor slots,
                    at::Tensor blocks, at::Tensor mask, at::Tensor norm1, at::Tensor qkv, at::Tensor o,
                    at::Tensor norm2, at::Tensor gate_up, at::Tensor down, int64_t heads, int64_t kv_heads,
                    int64_t inter, int64_t n) {
  const int64_t Hd = x.size(2), Dh = k.size(3);
  const int64_t shapes[4][2] = {{(heads + 2 * kv_heads) * Dh, Hd}, {Hd, heads * Dh}, {2 * inter, Hd}, {Hd, inter}};
  const at::Tensor* w[4] = {&qkv, &o, &gate_up, &down};
  return ns_per_call(n, [&] {
    check_layer("decoder_layer", x, cos, sin, k, v, slots, blocks, mask, norm1, qkv, c10::nullopt, o, c10::nullopt,
                norm2, gate_up, c10::nullopt, down, c10::nullopt, heads, kv_heads, inter, c10::nullopt, c10::nullopt);
    for (int i = 0; i < 4; i++) {
      check_tensor("packed_linear", "x", x, at::kBFloat16);
      check_packed("packed_linear", "wp", *w[i], shapes[i][0], shapes[i][1]);
      check_bias("packed_linear", "bias", c10::nullopt, shapes[i][0]);
    }
  });
}

double head_checks(at::Tensor x, at::Tensor norm, at::Tensor lm_head, int64_t vocab, int64_t n) {
  return ns_per_call(n, [&] {
    check_head("final_head", x, norm, lm_head, vocab);
    check_tensor("packed_linear", "x", x, at::kBFloat16);
    check_packed("packed_linear", "wp", lm_head, vocab, x.size(-1));
  });
}

double sample_checks(at::Tensor logits, at::Tensor r, int64_t n) {
  return ns_per_call(n, [&] { check_sample(logits, r, 1.0); });
}

double verify_checks(at::Tensor logits, at::Tensor tokens, at::Tensor num, at::Tensor q, at::Tensor u,
                     at::Tensor r, int64_t n) {
  return ns_per_call(n, [&] { check_verify(logits, tokens, num, q, u, r, 1.0); });
}
"""


def _extension():
    """The timing extension, linked against the kernels this process loaded."""
    from torch.utils.cpp_extension import load_inline

    from rlspec.rollout.runtime.model import kernels

    assert kernels.available(), "the kernels are not available here (no AVX-512 BF16, or no C++ toolchain)"
    lib = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
               if "rlspec_kernels_" in line and line.endswith(".so"))
    build = Path(tempfile.gettempdir()) / f"rlspec-check-bench-{kernels.source_digest()}"
    build.mkdir(exist_ok=True)
    return load_inline(f"rlspec_check_bench_{kernels.source_digest()}", [BENCH], build_directory=str(build),
                       functions=["layer_checks", "head_checks", "sample_checks", "verify_checks"],
                       extra_include_paths=[str(Path(kernels.__file__).parent)], extra_cflags=["-O3"],
                       extra_ldflags=[lib, f"-Wl,-rpath,{Path(lib).parent}"])


def _model(torch, kernels):
    bf = lambda *s: (torch.randn(*s) * 0.05).bfloat16()  # noqa: E731
    layers = [dict(norm1=bf(H), qkv=kernels.pack(bf((HEADS + 2 * KV) * D, H)), o=kernels.pack(bf(H, HEADS * D)),
                   norm2=bf(H), gate_up=kernels.pack(bf(2 * INTER, H)), down=kernels.pack(bf(H, INTER)))
              for _ in range(LAYERS)]
    return layers, bf(H), kernels.pack(bf(VOCAB, H))


def _step_inputs(torch, B, T, ctx):
    n = ctx // BS
    pools = [(torch.zeros(B * n + 1, BS, KV, D).bfloat16(), torch.zeros(B * n + 1, BS, KV, D).bfloat16())
             for _ in range(LAYERS)]
    blocks = torch.arange(1, B * n + 1).view(B, n)
    start = ctx - T
    slots = (blocks[:, -1:] * BS + (start % BS) + torch.arange(T)).view(B, T)
    pos = torch.arange(ctx)
    mask = (pos[None, :] <= (start + torch.arange(T))[:, None]).expand(B, 1, T, ctx).contiguous()
    cos, sin = torch.randn(B, T, 1, D).bfloat16(), torch.randn(B, T, 1, D).bfloat16()
    return pools, blocks, slots, mask, cos, sin


def add_arguments(parser) -> None:
    parser.add_argument("--ctx", type=int, default=2048, help="positions each row attends (whole blocks of 16)")
    parser.add_argument("--iters", type=int, default=2000, help="check calls per timing")


def run(args) -> dict:
    import torch

    from rlspec.rollout.runtime.model import kernels

    ctx, iters, reps = (256, 200, 1) if args.smoke else (args.ctx, args.iters, args.reps)
    ext = _extension()
    torch.manual_seed(args.seed)
    layers, norm, lm_head = _model(torch, kernels)
    inputs = {B: _step_inputs(torch, B, 1, ctx) for B in (1, 8)}
    # every check timing before any step: a step leaves OpenMP's threads spinning on the other core for a while
    rows = [_checks(torch, ext, layers[0], norm, lm_head, B, inputs[B], iters) for B in (1, 8)]
    K = 4
    verify_ns = _ns(lambda: ext.verify_checks(torch.randn(1, K + 1, VOCAB), torch.randint(VOCAB, (1, K)),
                                              torch.tensor([K]), torch.empty(0), torch.rand(1, K), torch.rand(1),
                                              iters))
    for row in rows:
        row["step_ms"] = _step_ms(torch, layers, norm, lm_head, row["batch"], inputs[row["batch"]], reps)
        row["share_pct"] = row["step_checks_us"] / row["step_ms"] / 10
    print(f"verify_chain_rows' checks (batch 1, {K} drafts): {verify_ns:.0f} ns a call")
    return {"rows": rows, "columns": list(rows[0]), "verify_checks_ns": verify_ns, "ctx": ctx, "no_plot": True}


def _ns(timing, times: int = 5) -> float:
    """The median of several timings (each a mean over a loop of calls): a preemption spoils one, not the figure."""
    return statistics.median(timing() for _ in range(times))


def _checks(torch, ext, w, norm, lm_head, B, inputs, iters) -> dict:
    """One batch size's checks, ns a call: a layer's (with its products'), the head's, the draw's; and a step's."""
    pools, blocks, slots, mask, cos, sin = inputs
    x, r = (torch.randn(B, 1, H) * 0.5).bfloat16(), torch.rand(B)
    layer_ns = _ns(lambda: ext.layer_checks(x, cos, sin, *pools[0], slots, blocks, mask, w["norm1"], w["qkv"], w["o"],
                                            w["norm2"], w["gate_up"], w["down"], HEADS, KV, INTER, iters))
    head_ns = _ns(lambda: ext.head_checks(x, norm, lm_head, VOCAB, iters))
    sample_ns = _ns(lambda: ext.sample_checks(torch.randn(B, VOCAB), r, iters))
    return {"batch": B, "layer_checks_ns": layer_ns, "head_checks_ns": head_ns, "sample_checks_ns": sample_ns,
            "step_checks_us": (LAYERS * layer_ns + head_ns + sample_ns) / 1e3}


def _step_ms(torch, layers, norm, lm_head, B, inputs, reps) -> float:
    """A decode step through the ops (30 decoder_layer calls, final_head, sample_rows), median of reps, in ms."""
    ops = torch.ops.rlspec_kernels
    pools, blocks, slots, mask, cos, sin = inputs
    x, r = (torch.randn(B, 1, H) * 0.5).bfloat16(), torch.rand(B)

    def step():
        h = x
        for (k, v), lw in zip(pools, layers):
            h = ops.decoder_layer(h, cos, sin, k, v, slots, blocks, mask, lw["norm1"], lw["qkv"], None, lw["o"], None,
                                  lw["norm2"], lw["gate_up"], None, lw["down"], None, HEADS, KV, INTER, 1e-5,
                                  D ** -0.5)
        return ops.sample_rows(ops.final_head(h, norm, lm_head, VOCAB, 1e-5).view(B, VOCAB), r, 1.0)

    step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
