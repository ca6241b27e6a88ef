"""The `profile` section: where a plain decode step's time goes at batch 1 and 128 (7B shape), one rollout
under torch.profiler per batch after a warm-up call that captured its graphs: the kernels with the most device
time, the ops with the most host time, synchronisations, and the host gap per decode step (wall time the device
was not busy: what a step waits for the host)."""
from __future__ import annotations

from rlspec.bench.gpucheck.common import build_hf, engine_over, fits, random_prompts, release


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, batches, prompt_len, new_tokens, top."""
    from rlspec.bench.gpucheck.profile_step import profile_call
    from rlspec.rollout.metrics import DECODE_STEPS
    from rlspec.rollout.types import SamplingParams

    B, new = max(cfg["batches"]), cfg["new_tokens"]
    out = {"shape": cfg["shape"], "rows": []}
    length = cfg["prompt_len"] + new + 8
    why = fits(cfg["shape"], B, length, 2, device, dtype)
    if why:
        return {**out, "skipped": why}
    hf = build_hf(cfg["shape"], dtype, device)
    prompts = random_prompts(B, cfg["prompt_len"], hf.config.vocab_size, seed=6)
    engine = engine_over(hf, device, dtype, B, length)
    del hf
    release(device)
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts, params)  # the pool at its largest
    for b in cfg["batches"]:
        if left() <= 0:
            break
        engine.generate(prompts[:b], params)  # the warm-up: b's graphs captured
        engine.stats()
        prof = profile_call(lambda: engine.generate(prompts[:b], params), device, cfg["top"])
        steps = int(engine.stats().get(DECODE_STEPS, 0))
        prof["decode_steps"] = steps
        prof["host_gap_ms_per_step"] = (prof["wall_s"] - prof["device_busy_s"]) / max(steps, 1) * 1e3
        prof["wall_ms_per_step"] = prof["wall_s"] / max(steps, 1) * 1e3
        out["rows"].append(dict(batch=b, **prof))
        print(f"  batch {b}: {prof['wall_ms_per_step']:.2f} ms a step, host gap {prof['host_gap_ms_per_step']:.2f} ms, "
              f"top kernel {prof['top_kernels'][0]['name'] if prof['top_kernels'] else '-'}", flush=True)
        save(out)
    return out
