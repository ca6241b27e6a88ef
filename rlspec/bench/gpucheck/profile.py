"""The `profile` section: where a plain decode step's time goes at batch 1 and 128 (7B shape), one rollout
under torch.profiler per batch after a warm-up call that captured its graphs: the kernels with the most device
time, the ops with the most host time, synchronisations, and the host gap per decode step (wall time the device
was not busy: what a step waits for the host). Then the same for a speculative rollout (`oracle`: a drafter of
known acceptance, oracle.py's, at one batch): where a speculative step's time goes beyond its verify."""
from __future__ import annotations

from rlspec.bench.gpucheck.common import build_hf, engine_over, fits, make_greedy_stable, random_prompts, release


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, batches, prompt_len, new_tokens, top; oracle (optional): batch, accept, k."""
    from rlspec.bench.gpucheck.oracle import OracleDrafter
    from rlspec.rollout.types import SamplingParams, SpecConfig

    B, new, o = max(cfg["batches"]), cfg["new_tokens"], cfg.get("oracle")
    out = {"shape": cfg["shape"], "rows": []}
    length = cfg["prompt_len"] + new + 8 + (o["k"] if o else 0)
    why = fits(cfg["shape"], B, length, 3 if o else 2, device, dtype)
    if why:
        return {**out, "skipped": why}
    hf = build_hf(cfg["shape"], dtype, device)
    make_greedy_stable(hf)  # the oracle's drafts are the target's greedy continuation: kept where it is stable
    prompts = random_prompts(B, cfg["prompt_len"], hf.config.vocab_size, seed=6)
    engine = engine_over(hf, device, dtype, B, length)
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts, params)  # the pool at its largest
    arms = [(engine, b, "plain") for b in cfg["batches"]]
    if o:
        ref = engine.generate(prompts[:o["batch"]], params)
        drafter = OracleDrafter({tuple(r.prompt_ids): list(r.completion_ids) for r in ref}, hf.config.vocab_size,
                                o["accept"])
        spec = SpecConfig(drafter="ngram", selector="always", num_draft_tokens=o["k"], online_training=False)
        arms.append((engine_over(hf, device, dtype, o["batch"], length, spec=spec, drafter=drafter), o["batch"],
                     f"oracle a={o['accept']} k={o['k']}"))
    del hf
    release(device)
    for eng, b, arm in arms:
        if left() <= 0:
            break
        out["rows"].append(dict(batch=b, arm=arm, **_profiled(eng, prompts[:b], params, device, cfg["top"])))
        prof = out["rows"][-1]
        print(f"  batch {b} {arm}: {prof['wall_ms_per_step']:.2f} ms a step, host gap "
              f"{prof['host_gap_ms_per_step']:.2f} ms, top kernel "
              f"{prof['top_kernels'][0]['name'] if prof['top_kernels'] else '-'}", flush=True)
        save(out)
    return out


def _profiled(engine, prompts, params, device, top: int) -> dict:
    """One call under the profiler after an untimed one (its graphs captured), per decode step."""
    from rlspec.bench.gpucheck.profile_step import profile_call
    from rlspec.rollout.metrics import ACCEPT_LEN, AHEAD_SHARE, DECODE_STEPS

    engine.generate(prompts, params)
    engine.stats()
    prof = profile_call(lambda: engine.generate(prompts, params), device, top)
    stats = engine.stats()
    steps = int(stats.get(DECODE_STEPS, 0))
    return dict(prof, decode_steps=steps, accept_len=stats.get(ACCEPT_LEN), ahead_share=stats.get(AHEAD_SHARE),
                host_gap_ms_per_step=(prof["wall_s"] - prof["device_busy_s"]) / max(steps, 1) * 1e3,
                wall_ms_per_step=prof["wall_s"] / max(steps, 1) * 1e3)
