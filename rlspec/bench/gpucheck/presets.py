"""The device check's shapes and limits, one preset for an H100 and one for the CPU rehearsal (--smoke), and the
summary it prints. The GPU limits add up to under 10 minutes (one device call), the core (tests + plain) to
under 5; the rehearsal's sections take seconds each on a CPU. Stdlib only."""
from __future__ import annotations

import importlib

TEST_TARGETS = ["tests/gpu", "tests/rollout/runtime/test_graphs.py"]  # run under `-m gpu`

GPU = {
    "plain": dict(shapes=["smollm2-135m", "qwen2.5-7b"], batches=[1, 8, 32, 128], prompt_len=64,
                  new_tokens={"smollm2-135m": 128, "qwen2.5-7b": 32}, iters=20),
    "spec_costs": dict(shape="qwen2.5-7b", batches=[1, 8, 32, 128], verify_tokens=[2, 3, 4, 5, 6, 7, 8],
                       tree_tokens=[3, 4, 5, 6, 7, 8], ctx=256, iters=10, draft_batches=[1, 8, 32],
                       draft_new_tokens=32, prompt_len=64),
    "oracle": dict(shape="qwen2.5-7b", batches=[1, 8, 32], accepts=[0.5, 0.7, 0.9], num_draft_tokens=4,
                   prompt_len=64, new_tokens=64),
    "grpo": dict(shape="smollm2-135m", steps=3, batch=8, generations=4, max_completion_length=64),
}
SMOKE = {
    "plain": dict(shapes=["tiny"], batches=[1, 2], prompt_len=8, new_tokens={"tiny": 8}, iters=3),
    "spec_costs": dict(shape="tiny", batches=[1, 2], verify_tokens=[2, 5], tree_tokens=[4], ctx=16, iters=2,
                       draft_batches=[1], draft_new_tokens=8, prompt_len=8),
    "oracle": dict(shape="tiny", batches=[1, 2], accepts=[0.5, 0.7, 0.9], num_draft_tokens=4, prompt_len=8,
                   new_tokens=16),
    "grpo": dict(shape="tiny", steps=3, batch=4, generations=2, max_completion_length=8),
}
# seconds per section: the tests' whole pass, then each child's limit
GPU_LIMITS = dict(tests=270, plain=110, spec_costs=95, oracle=70, grpo=45)  # H200: ~270, 97, 84, 63, 34 s
SMOKE_LIMITS = dict(tests=120, plain=120, spec_costs=120, oracle=120, grpo=150)  # ~10-30 s each when idle


def config(name: str, smoke: bool, tokenizer: str | None = None) -> dict:
    cfg = dict((SMOKE if smoke else GPU)[name])
    if name == "grpo":
        cfg["tokenizer"] = tokenizer
    return cfg


def timeouts(smoke: bool, overrides: list[str] | None = None) -> dict[str, float]:
    """Each section's limit in seconds; overrides: ["oracle=200", ...]."""
    limits = dict(SMOKE_LIMITS if smoke else GPU_LIMITS)
    for item in overrides or []:
        name, _, value = item.partition("=")
        if name not in limits or not value:
            raise SystemExit(f"--timeout-s {item!r}: expected SECTION=SECONDS with SECTION one of {list(limits)}")
        limits[name] = float(value)
    return limits


def per_test_timeout(smoke: bool) -> float:
    return 60.0 if smoke else 90.0


def module(name: str):
    return importlib.import_module(f"rlspec.bench.gpucheck.{name}")


def print_summary(report: dict) -> None:
    """One line per section, then the rows that answer its question."""
    print(f"\n{report['device']} (torch {report['torch']}), {report.get('elapsed_s', 0):.0f} s")
    for name in ("tests", "plain", "spec_costs", "oracle", "grpo"):
        sec = report.get(name)
        if sec is None:
            continue
        extra = sec.get("counts") or sec.get("skipped") or ""
        print(f"  {name:<11} {sec['status']:<18} {extra}")
    for r in report.get("plain", {}).get("rows", []):
        print(f"  plain  {r['model']:<13} batch {r['batch']:>3}: engine {r['engine_tok_s']:8.0f} tok/s "
              f"(x{r['speedup_vs_hf']:.1f} HF), graph step {r['step_graph_ms']:.2f} ms")
    for r in report.get("oracle", {}).get("rows", []):
        predicted = f", predicted x{r['predicted_speedup']:.2f}" if "predicted_speedup" in r else ""
        print(f"  oracle batch {r['batch']:>3} a={r['accept']}: x{r['speedup']:.2f} plain{predicted}, accept_len "
              f"{r['accept_len']} (expected {r['expected_accept_len']:.2f})")
