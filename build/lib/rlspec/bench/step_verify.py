"""The verify half of `python -m rlspec.bench step`: a batch-1 step of T tokens (T = 1 is the plain step, T > 1
a chain of T-1 drafts) at the step runner, by arm, and what a drafted token costs per proposer.

Verify arms, alternated over --reps repetitions (medians), compiled and warmed before timing:
  fused               the engine (compile_mode="auto", each layer one C++ op: rollout/runtime/model/fused.py)
  compiled            steps of up to 16 tokens compiled, products and attention through the bf16 kernels
  inductor-attention  compiled, attending through inductor's fused gather/softmax (no paged-attention kernel)
  eager-verify        only one-token steps compiled (no verify kernel)
"""
from __future__ import annotations

import contextlib
import statistics
import time

from rlspec.bench.common import math_prompts

VERIFY_ARMS = ("fused", "compiled", "inductor-attention", "eager-verify")


@contextlib.contextmanager
def fused_steps(on: bool):
    """While an arm's steps run: fused steps (model/fused.py) on or off; off, the engine compiles them."""
    from rlspec.rollout.runtime.model import fused

    saved = fused.enabled
    fused.enabled = on
    try:
        yield
    finally:
        fused.enabled = saved


@contextlib.contextmanager
def eager_verify():
    """While it lasts, step runners built compile one-token steps only: steps of several tokens run eagerly."""
    from rlspec.rollout.runtime.compiled import CompiledRunner

    saved = CompiledRunner.__dict__["cpu_max_rows"]
    CompiledRunner.cpu_max_rows = staticmethod(lambda model: 1)
    try:
        yield
    finally:
        CompiledRunner.cpu_max_rows = saved


@contextlib.contextmanager
def verify_arm(arm: str):
    """Fused steps only for `fused`; `inductor-attention` attends through inductor (dynamo keeps both graphs,
    guarded on the switch)."""
    from rlspec.rollout.runtime.model import kernels

    saved = kernels.attention
    kernels.attention = arm != "inductor-attention"
    try:
        with fused_steps(arm == "fused"):
            yield
    finally:
        kernels.attention = saved


def _runners(args) -> dict:
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model.fetch import fetch_model

    path, top, arms = fetch_model(args.model), max(args.verify_ctx), {}
    for arm in VERIFY_ARMS:
        eng = RolloutEngine.from_pretrained(path, dtype=args.dtype, max_num_seqs=1, compile_mode="auto")
        with eager_verify() if arm == "eager-verify" else contextlib.nullcontext():  # the step runner is built here
            cache = eng.runner.ensure_cache(1, top + 64)
        cache.grow([(0, "bench", top + 32)])
        arms[arm] = eng.runner
    return arms


def _time_arm(runner, arm, tokens, start, steps: int) -> float:
    with verify_arm(arm):
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step(tokens, start)
    return (time.perf_counter() - t0) / steps * 1e3


def verify_rows(args) -> list[dict]:
    """Batch-1 step time (ms) at T tokens per row and each --verify-ctx context, per arm, and each arm's T-token
    step over its own plain step."""
    import torch

    arms, rows = _runners(args), []
    for ctx in args.verify_ctx:
        start = torch.tensor([ctx])
        for T in (1, *args.verify_tokens):
            tokens = torch.randint(100, 1000, (1, T), generator=torch.Generator().manual_seed(T))
            for arm, runner in arms.items():  # compile and warm
                with verify_arm(arm):
                    for _ in range(3):
                        runner.step(tokens, start)
            runs = {arm: [] for arm in arms}
            for _ in range(args.reps):
                for arm, runner in arms.items():
                    runs[arm].append(_time_arm(runner, arm, tokens, start, args.steps))
            rows.append({"ctx": ctx, "tokens": T, **{f"{a}_ms": statistics.median(v) for a, v in runs.items()},
                         "runs": runs})
            print(f"[step] verify ctx {ctx} T={T}: " + ", ".join(f"{a} {rows[-1][f'{a}_ms']:.2f} ms" for a in arms),
                  flush=True)
    for r in rows:
        base = next(b for b in rows if b["ctx"] == r["ctx"] and b["tokens"] == 1)
        for a in arms:
            r[f"{a}_vs_plain"] = r[f"{a}_ms"] / base[f"{a}_ms"]  # against the same arm's plain step
    return rows


def draft_costs(args) -> list[dict]:
    """Each proposer's time per drafted token as a share of a plain step (the engine's rollout/draft_cost),
    over a batch-1 rollout with the drafter forced on every step."""
    from rlspec.rollout import metrics as M
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.rollout.types import SamplingParams, SpecConfig

    path, rows = fetch_model(args.model), []
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
