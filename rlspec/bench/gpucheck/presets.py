"""The device check's sections, shapes and limits: one preset for an H200-class GPU and one for the CPU rehearsal
(--smoke), and the summary it prints. Stdlib only.

Limits: the core (the CUDA smoke subset, plain, spec_costs) adds up to 300 s and everything to 600 s (one device
call). Each is sized from the H200 run's section times (bench_out/gpu_2026-11-30/report.json: the smoke subset's
16 tests 112 s, plain 58 s, spec_costs' verify rows 72 s, profile 24 s, contexts 16 s, oracle 56 s, e2e's two first arms
~40 s); contexts has 15 s more for the paged kernel's launches timed alone (a compile each, ~1 s), taken from
tests_rest, the last. That run predates our Triton kernels: the compiles of their first launches are mostly paid
beside the CUDA tests, by the compile-ahead child (ahead.py), and each section reports what it still compiled. A
section stops starting measurements at 0.8 of its limit, so what it measured comes back either way; what a section
leaves of its limit goes to the ones after it (gpu.run), so tests_rest, which ran out in that run, gets what the
measuring sections did not use."""
from __future__ import annotations

import importlib

SECTIONS = ("tests", "plain", "spec_costs", "profile", "contexts", "oracle", "e2e", "tests_rest")  # the check
EXTRAS = ("compiled",)  # run only when asked (--sections compiled): questions for a device call of their own
CORE = ("tests", "plain", "spec_costs")
TEST_SECTIONS = ("tests", "tests_rest")
TEST_TARGETS = ["tests/gpu", "tests/rollout/runtime/test_graphs.py"]  # run under `-m gpu`
# the core's CUDA smoke subset, in this order: greedy parity, the sampling law, our Triton kernels (each, and all at
# once in a bf16 engine replaying graphs: what every figure after rests on), greedy exactness under speculation and
# graphs, paging, the drafter's graph levels (node-id prefixes). tests_rest runs every other test of TEST_TARGETS,
# among them test_graphs.py's replay against eager (38 s in the core of 2026-11-30, where its limit then cut the
# drafter's graph levels; the engine tests above replay graphs too)
# tests_rest runs these last: the compiled layers (off by default on CUDA), each test an Inductor compile of its own,
# what the section's time runs out for first
LAST_TESTS = [
    "tests/gpu/test_cuda_engine.py::test_compiled_graph_replay_equals_eager",
    "tests/gpu/test_cuda_engine.py::test_compiled_engine_greedy_matches_transformers_on_cuda",
    "tests/gpu/test_cuda_device_order.py::test_one_compile_of_the_captured_layer_serves_every_batch_bucket",
]
CORE_TESTS = [
    "tests/gpu/test_cuda_engine.py::test_greedy_matches_transformers_generate",
    "tests/gpu/test_cuda_engine.py::test_seeded_sampling_has_the_target_law",
    "tests/gpu/test_cuda_triton.py",
    "tests/gpu/test_cuda_engine.py::test_greedy_exact_with_speculation_and_graphs",
    "tests/gpu/test_cuda_paging.py",
    "tests/gpu/test_cuda_eagle3_graphs.py",
]

GPU = {
    "plain": dict(shapes=["smollm2-135m", "qwen2.5-7b"], batches=[1, 8, 32, 128], prompt_len=64,
                  new_tokens={"smollm2-135m": 64, "qwen2.5-7b": 32}, iters=10, repeats=3, hf_batches=[1, 32]),
    "spec_costs": dict(shape="qwen2.5-7b", batches=[1, 8, 32, 128], verify_tokens=[2, 3, 4, 5, 8],
                       tree_tokens=[5], ctx=256, iters=6, repeats=3, draft_batches=[1, 8, 32],
                       draft_new_tokens=24, prompt_len=64),
    "profile": dict(shape="qwen2.5-7b", batches=[1, 128], prompt_len=64, new_tokens=16, top=12,
                    oracle=dict(batch=8, accept=0.7, k=4)),
    "contexts": dict(shape="qwen2.5-7b", batches=[1, 8, 32], contexts=[256, 2048, 8192], iters=6, repeats=3,
                     compare=dict(kernel="flex", rows=[[256, 1], [8192, 1], [8192, 32]]),
                     without_pdl=[[256, 1], [256, 32]],  # our kernels launched without PDL: its gain
                     # the paged kernel alone: its default launch, then others [keys, stages, programs an SM]
                     attention=dict(rows=[[256, 1], [2048, 32], [8192, 1], [8192, 32]],
                                    launches=[[32, 3, 2], [64, 4, 2], [64, 3, 1], [64, 3, 3], [32, 3, 4]]),
                     # the device n-gram drafter's lookup alone: [rows, texts a row (its group), context]
                     lookup=dict(rows=[[64, 1, 2048], [64, 8, 2048], [256, 8, 2048], [256, 16, 2048], [256, 8, 8192]]),
                     draw=dict(rows=[1, 32, 128, 512], vocab=152064)),  # a plain step's draw alone
    "oracle": dict(shape="qwen2.5-7b", batches=[1, 8, 32], accepts=[0.5, 0.7, 0.9], num_draft_tokens=4,
                   prompt_len=64, new_tokens=[8, 56], repeats=3),
    "compiled": dict(shape="qwen2.5-7b", batches=[1, 8, 32, 128], context=256, iters=6, repeats=3),
    "e2e": dict(shape="smollm2-135m-untied", steps=3, batch=8, generations=4, max_completion_length=64, accept=0.7,
                num_draft_tokens=4, arms=["trl", "spec", "spec-oracle"], temperature=1.0),
}
SMOKE = {
    "plain": dict(shapes=["tiny"], batches=[1, 2], prompt_len=8, new_tokens={"tiny": 8}, iters=3, repeats=3,
                  hf_batches=[1]),
    "spec_costs": dict(shape="tiny", batches=[1, 2], verify_tokens=[2, 5], tree_tokens=[4], ctx=16, iters=2,
                       repeats=3, draft_batches=[1, 2], draft_new_tokens=8, prompt_len=8),
    "profile": dict(shape="tiny", batches=[1, 2], prompt_len=8, new_tokens=6, top=8,
                    oracle=dict(batch=2, accept=0.7, k=4)),
    "contexts": dict(shape="tiny", batches=[1, 2], contexts=[16, 64], iters=2, repeats=3,
                     compare=dict(kernel="flex", rows=[[64, 2]]), without_pdl=[[16, 1]],
                     attention=dict(rows=[[64, 2]], launches=[[16, 3, 2]]), lookup=dict(rows=[[4, 2, 64]]),
                     draw=dict(rows=[1, 2], vocab=300)),
    "oracle": dict(shape="tiny", batches=[1, 2], accepts=[0.5, 0.7, 0.9], num_draft_tokens=4, prompt_len=8,
                   new_tokens=[8, 24], repeats=3),
    "compiled": dict(shape="tiny", batches=[2], context=16, iters=2, repeats=3),  # one graph family: C++ compiles
    # temperature: the tiny shape's greedy margin (~sqrt(hidden) = 8 logits) against a 49k vocabulary is sampled
    # away at T = 1; at 0.25 the sampled continuation is the greedy one, as SmolLM2's (24 logits) at T = 1
    "e2e": dict(shape="tiny", steps=1, batch=4, generations=2, max_completion_length=8, accept=0.7,
                num_draft_tokens=4, arms=["trl", "spec", "spec-oracle"], temperature=0.25),
}
# seconds per section; the core's add up to 300, all to 600 (sized from bench_out/gpu_2026-11-30/report.json's seconds)
GPU_LIMITS = dict(tests=140, plain=65, spec_costs=95, profile=40, contexts=45, oracle=55, e2e=100, tests_rest=60)
EXTRA_LIMITS = dict(compiled=180)
SMOKE_LIMITS = dict(tests=120, plain=120, spec_costs=120, profile=120, contexts=120, oracle=120, e2e=200,
                    tests_rest=120)
# what a device's memory reads at (bytes/s), for the bandwidth limit beside each plain step (by device name)
HBM_BYTES_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}


# the sections' light form for the compile-ahead child (ahead.py): the same shapes, batches and launches, each
# timed once, without transformers' baseline
AHEAD = dict(repeats=1, iters=1, hf_batches=[])


def config(name: str, smoke: bool, tokenizer: str | None = None, ahead: bool = False) -> dict:
    cfg = dict((SMOKE if smoke else GPU)[name])
    if ahead:
        cfg.update({k: v for k, v in AHEAD.items() if k in cfg})
    if name == "e2e":
        cfg["tokenizer"] = tokenizer
    return cfg


def timeouts(smoke: bool, overrides: list[str] | None = None) -> dict[str, float]:
    """Each section's limit in seconds; overrides: ["oracle=200", ...]."""
    limits = {**(SMOKE_LIMITS if smoke else GPU_LIMITS), **EXTRA_LIMITS}
    for item in overrides or []:
        name, _, value = item.partition("=")
        if name not in limits or not value:
            raise SystemExit(f"--timeout-s {item!r}: expected SECTION=SECONDS with SECTION one of {list(limits)}")
        limits[name] = float(value)
    return limits


def per_test_timeout(smoke: bool) -> float:
    return 60.0 if smoke else 90.0


def hbm_bytes_s(device_name: str) -> float | None:
    """The device's memory bandwidth by its name (None: not in the table, or a CPU)."""
    return next((bw for key, bw in HBM_BYTES_S.items() if key in device_name), None)


def module(name: str):
    return importlib.import_module(f"rlspec.bench.gpucheck.{name}")


def print_summary(report: dict) -> None:
    """One line per section, then the rows that answer its question."""
    print(f"\n{report['device']} (torch {report['torch']}), {report.get('elapsed_s', 0):.0f} s, "
          f"commit {report.get('commit')}{' (dirty)' if report.get('dirty') else ''}")
    for name in SECTIONS + EXTRAS:
        sec = report.get(name)
        if sec is None:
            continue
        extra = sec.get("counts") or sec.get("skipped") or ""
        compiled = sec.get("triton_compiles") or {}
        if compiled.get("count"):
            extra = f"{extra} (Triton compiles: {compiled['count']}, {compiled['seconds']} s)".lstrip()
        print(f"  {name:<11} {sec['status']:<18} {sec.get('seconds', '')} s {extra}")
    early = report.get("ahead")
    if early:
        c = early["triton_compiles"]
        print(f"  ahead       {early['status']:<18} {early['seconds']} s ({', '.join(early['sections'])}: Triton "
              f"compiles {c['count']}, {c['built']} built, {c['seconds']} s)")
    for r in report.get("plain", {}).get("rows", []):
        print(f"  plain  {r['model']:<13} batch {r['batch']:>3}: engine {r['engine_tok_s']:8.0f} tok/s, graph step "
              f"{r['step_graph_ms']:.2f} ms (limit {r.get('limit_ms')}), captures / compiles in timed calls "
              f"{r['timed_captures']} / {r.get('timed_compiles')}")
    for c in report.get("plain", {}).get("products", []):
        print(f"  product {c['weight']} x {c['rows']} rows: ours {c['ours_us']} us, torch {c['torch_us']} us"
              f"{' (ours serves)' if c['ours'] else ''}")
    for r in report.get("contexts", {}).get("rows", []):
        how = f"{r.get('kernel')}{'' if r.get('pdl') else ', no PDL'}"
        print(f"  ctx {r['context']:>5} batch {r['batch']:>3} ({how}): {r['step_ms']:.2f} ms, x{r.get('over_limit')} "
              "limit")
    attention = report.get("contexts", {}).get("attention")
    for r in attention if isinstance(attention, list) else []:
        launch = f"keys {r['keys']} stages {r['stages']} per_sm {r['per_sm']}" + (" (default)" if r["default"] else "")
        got = r.get("error") or f"{r['us']:.1f} us, {r['kv_tb_s']:.2f} TB/s of KV"
        print(f"  attention ctx {r['context']:>5} batch {r['batch']:>3}, {launch}: {got}")
    for r in report.get("oracle", {}).get("rows", []):
        predicted = f", formula x{r['predicted_speedup']:.2f} ({r['vs_predicted']:.2f} of it)" \
            if "vs_predicted" in r else ""
        print(f"  oracle batch {r['batch']:>3} a={r['accept']}: decode x{r['decode_speedup']:.2f} plain{predicted}, "
              f"whole call x{r['speedup']:.2f}, accept_len {r['accept_len']:.2f} (expected "
              f"{r['expected_accept_len']:.2f})")
    for r in report.get("compiled", {}).get("rows", []):
        print(f"  compiled batch {r['batch']:>3}: {r['step_ms_off']:.2f} -> {r['step_ms_on']:.2f} ms "
              f"(x{r['speedup']:.2f})")
    for r in report.get("e2e", {}).get("rows", []):
        print(f"  e2e {r['arm']:<12} {r['step_s']:.2f} s a step (rollout {r['rollout_s']:.2f} s)")
