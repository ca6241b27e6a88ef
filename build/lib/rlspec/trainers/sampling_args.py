"""TRL's sampling options -> the engine's SamplingParams fields, refusing what the engine does not honour.

TRL hands its sampling options to generation two ways: the config fields (temperature, top_p, top_k,
min_p, repetition_penalty) and `generation_kwargs`, which its own generation applies on top of them
(trl/trainer/grpo_trainer.py: `generation_kwargs.update(args.generation_kwargs)` into a GenerationConfig
on the transformers path, into vLLM's SamplingParams on the vLLM path). The engine implements exactly
these five, in transformers' order and arithmetic (rollout/runtime/sampling.py), and do_sample / num_beams=1,
which change nothing it does; any other key (a beam search, a typical_p, stop strings...) it would silently
ignore, so SpecGRPOTrainer leaves those runs to TRL's own generation, saying so by name (trl_compat.py).

TRL recomputes the policy's logprobs at its config temperature; a `generation_kwargs` temperature that
differs changes the sampler only, as in TRL, and the engine's sampling logprobs are at the temperature
it sampled with (docs/verification.md#logprobs).
"""
from __future__ import annotations

from rlspec.rollout.types import SamplingParams

# the generation_kwargs keys the engine applies exactly as transformers' generate and vLLM do
SUPPORTED_GENERATION_KWARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# keys that change nothing when the engine samples one sequence per draw: beam-search settings at one beam
NO_OP_WITHOUT_BEAMS = ("length_penalty", "early_stopping")


def unsupported_generation_kwargs(generation_kwargs: dict | None) -> list[str]:
    """The generation_kwargs keys the engine cannot honour exactly (empty: it can). do_sample and num_beams=1
    (with the beam-only settings that then do nothing) are honoured: the engine samples, or decodes greedily
    for do_sample=False, one sequence per draw."""
    extra = dict(generation_kwargs or {})
    beams = extra.get("num_beams", 1) not in (None, 1)
    ok = {*SUPPORTED_GENERATION_KWARGS, "do_sample", *(() if beams else ("num_beams", *NO_OP_WITHOUT_BEAMS))}
    return sorted(k for k in extra if k not in ok)


def engine_sampling(temperature: float, top_p: float | None, top_k: int | None, min_p: float | None,
                    repetition_penalty: float | None, generation_kwargs: dict | None) -> dict:
    """The SamplingParams fields for TRL's options, generation_kwargs winning as in TRL. None and TRL's
    "off" values map to ours (top_k 0 or -1 -> 0, min_p None -> 0; do_sample=False -> greedy, temperature 0).
    Validated now (SamplingParams' messages), so a bad value fails when the trainer is built, not at the
    first rollout. Keys the engine cannot honour raise (the trainer checks unsupported_generation_kwargs
    first and generates with TRL's own generation for them)."""
    extra = dict(generation_kwargs or {})
    unsupported = unsupported_generation_kwargs(extra)
    if unsupported:
        raise ValueError(f"generation_kwargs {unsupported} are not supported by the rlspec engine, which would "
                         f"ignore them; supported keys: {list(SUPPORTED_GENERATION_KWARGS)}, do_sample, and "
                         "num_beams=1 (or use trl.GRPOTrainer, whose own generation applies any GenerationConfig field)")
    given = {**dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                    repetition_penalty=repetition_penalty),
             **{k: v for k, v in extra.items() if k in SUPPORTED_GENERATION_KWARGS}}
    out = dict(temperature=0.0 if extra.get("do_sample") is False else float(given["temperature"]),
               top_p=1.0 if given["top_p"] is None else float(given["top_p"]),
               top_k=max(int(given["top_k"] or 0), 0),  # TRL and HF use 0 or -1 (vLLM) for "off"; ours is 0
               min_p=float(given["min_p"] or 0.0),
               repetition_penalty=1.0 if given["repetition_penalty"] is None else float(given["repetition_penalty"]))
    SamplingParams(**out)
    return out


def grpo_sampling(trainer) -> dict:
    """engine_sampling for a TRL GRPOTrainer after its __init__ (its fields and args.generation_kwargs)."""
    return engine_sampling(trainer.temperature, trainer.top_p, trainer.top_k, trainer.min_p,
                           trainer.repetition_penalty, trainer.args.generation_kwargs)
