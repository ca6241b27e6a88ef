"""What SpecGRPOTrainer and SpecRLOOTrainer do so that everything plain `trl.GRPOTrainer` / `trl.RLOOTrainer`
accept still runs (trl 1.16). The importance-sampling settings and rollout_func are GRPO's (RLOO has neither).

- A policy the engine cannot run (rollout.errors.UnsupportedModelError at engine construction: an unknown
  model_type, a RoPE or attention kind the runtime does not compute, a PEFT method that cannot be merged)
  is not an error: the trainer warns once and generates through TRL's own `_generate_single_turn`, with
  TRL's importance-sampling settings exactly as plain TRL has them without vLLM (off). `rollout/engine`
  (1: the rlspec engine sampled this step, 0: TRL's generation) says in W&B which path sampled. An FSDP run
  takes the same path: its sharded parameters are what the engine's weight sync cannot read.
- Vision-language models (a ProcessorMixin processing class, TRL's own test for `_is_vlm`) are
  refused at construction: the engine generates text only, and a silent fallback would hide that the
  speculative engine never runs.
- TRL's importance-sampling correction is turned on for the engine (`turn_on_importance_sampling`), with
  the one adjustment loss_type="vespo" needs (see `importance_sampling_mode`).
- A `rollout_func` that returns no logprobs gets NaN ones (`with_sampling_logprobs`), which TRL's
  correction treats as "no correction", so it trains as it would in plain TRL.
"""
from __future__ import annotations

import logging
import warnings

from rlspec.rollout.errors import UnsupportedModelError

logger = logging.getLogger(__name__)


def _transformers_generate():
    from transformers import GenerationMixin

    return GenerationMixin.generate


_HF_GENERATE = _transformers_generate()  # as imported, before any test or user patches it

ENGINE_METRIC = "rollout/engine"  # 1.0: the rlspec engine sampled; 0.0: TRL's own generation
TOKEN_LEVEL_FOR_VESPO = {"sequence_mask": "token_mask", "sequence_truncate": "token_truncate"}


def refuse_vlm(processing_class, trainer: str = "SpecGRPOTrainer", trl_trainer: str = "GRPOTrainer") -> None:
    """Refuse a vision-language policy at construction, before any engine is built. TRL's test: a VLM is
    one whose processing class is a ProcessorMixin (GRPOTrainer.__init__ sets `_is_vlm` from it).
    trainer / trl_trainer: the rlspec class and the TRL class it replaces, for the message."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin):
        raise ValueError(
            f"{trainer}'s engine generates text only, and this model comes with a multimodal processor "
            f"(a vision-language model): use trl.{trl_trainer} for it (same arguments, without spec_config, "
            "engine and engine_kwargs)")


def why_not_the_engine(model, generation_kwargs: dict | None) -> str | None:
    """Why TRL's own generation, not the engine, must sample for this run (None: the engine can):
    generation_kwargs the engine cannot honour (sampling_args.py), or a model whose `generate` is not
    transformers' own (overridden by its class or patched): the engine could not reproduce custom decoding."""
    from transformers import GenerationMixin

    from rlspec.trainers.sampling_args import SUPPORTED_GENERATION_KWARGS, unsupported_generation_kwargs

    keys = unsupported_generation_kwargs(generation_kwargs)
    if keys:
        return (f"generation_kwargs {keys} are not honoured by the engine (it honours "
                f"{list(SUPPORTED_GENERATION_KWARGS)}, do_sample and num_beams=1)")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(type(base), "generate", _HF_GENERATE) is not _HF_GENERATE or GenerationMixin.generate is not _HF_GENERATE:
        return "the model's generate is not transformers' own (overridden or patched)"
    return None


def engine_or_trl_generation(build, engine_given: bool, fsdp: bool = False, why_not: str | None = None,
                             trainer: str = "SpecGRPOTrainer"):
    """build() (a RolloutSource), or None after one warning when the engine cannot run the policy.

    engine_given: the user passed an engine; it already runs the model, so an UnsupportedModelError then
    comes from something else and is raised as is.
    fsdp: the Trainer will shard the policy with FSDP, whose flat shards / DTensors the weight sync cannot push
    (trainers/weight_sync.py); TRL's generation gathers them itself (summon_full_params), so it samples instead.
    trainer: the rlspec class's name, for the warning."""
    if why_not is not None and not engine_given:
        return _trl_generation(why_not, trainer)
    if fsdp and not engine_given:
        return _trl_generation("the policy is FSDP-sharded, and the engine's weight sync reads whole tensors "
                               "(DeepSpeed ZeRO-3 keeps the engine: accelerate launch --config_file "
                               "configs/accelerate/zero3.yaml)", trainer)
    try:
        return build()
    except UnsupportedModelError as e:
        if engine_given:
            raise
        return _trl_generation(str(e), trainer)


def _trl_generation(why: str, trainer: str) -> None:
    warnings.warn(f"{trainer}: rlspec's rollout engine cannot sample this run as TRL would ({why}); generating with TRL's "
                  "own generation instead (no speculation; TRL's importance-sampling settings as in plain TRL). The "
                  f"metric {ENGINE_METRIC} is 0 on this path", UserWarning, stacklevel=4)


def importance_sampling_mode(trainer) -> str:
    """The vllm_importance_sampling_mode to run the correction with.

    TRL applies the correction to loss_type="vespo" inside its gamma weights, as a sum of per-token log
    ratios, and refuses vespo with a sequence_* mode when vLLM is on (GRPOTrainer.__init__). Plain TRL
    without vLLM never sees that refusal because it runs no correction at all, so a vespo config with the
    default "sequence_mask" is one plain TRL accepts. Dropping the correction would be wrong for us: with a
    lossy mode the engine's tokens come from a behaviour law that differs from the policy, and the
    correction is what accounts for it. So we keep it on and use the token-level mode of the same kind
    (mask -> token_mask, truncate -> token_truncate, with the user's clip bounds), which is what TRL's
    vespo accepts, and say so in the log.

    Likewise, when the engine samples in another dtype than the master weights' (bf16 from float32 under
    mixed precision, trainers/sampling_dtype.py) and the mode is TRL's default, token_truncate replaces
    sequence_mask: the default would drop whole samples over rounding (docs/sampling_dtype.md gives the
    measured share). TRL's default value counts as unset; a user who wants sequence_mask samples in float32.
    """
    mode = trainer.vllm_importance_sampling_mode
    if trainer.loss_type == "vespo" and mode in TOKEN_LEVEL_FOR_VESPO:
        new = TOKEN_LEVEL_FOR_VESPO[mode]
        logger.info("SpecGRPOTrainer: loss_type='vespo' takes a token-level importance-sampling correction; "
                    "using vllm_importance_sampling_mode=%r instead of %r", new, mode)
        return new
    if getattr(trainer, "partial", None) is not None and mode.startswith("sequence_"):
        # a carried sample's ratio multiplies over every older token: a sequence-level mode would zero or cap
        # whole long samples, the very ones partial rollouts carry (docs/partial_rollouts.md#accounting-every-token-keeps-the-law-it-was-drawn-from)
        cap = trainer.vllm_importance_sampling_clip_max
        logger.warning("SpecGRPOTrainer: partial rollouts carry samples across policy updates; "
                       "vllm_importance_sampling_mode=%r would mask or cap whole carried sequences, so "
                       "'token_truncate' (%s) is used instead", mode,
                       "each token's ratio unclipped" if cap is None else f"each token's ratio clipped at {cap:g}")
        return "token_truncate"
    sampled, stored = getattr(trainer, "rlspec_sampling_dtypes", (None, None))
    if mode == TRL_DEFAULT_IS_MODE and sampled is not None and sampled != stored:
        # bf16 sampling against float32 master weights: per-token log-ratios are small but sum over a sequence,
        # and TRL's default zeroes a whole sample whose summed ratio passes the cap (docs/sampling_dtype.md)
        logger.warning("SpecGRPOTrainer: rollouts are sampled in %s from %s master weights; TRL's default "
                       "vllm_importance_sampling_mode='sequence_mask' would drop whole samples over a summed "
                       "rounding difference, so 'token_truncate' (each token's ratio clipped at %s) is used instead. "
                       "Sample in %s (engine_kwargs={'dtype': '%s'}) to keep TRL's default",
                       _name(sampled), _name(stored), trainer.vllm_importance_sampling_clip_max, _name(stored),
                       _name(stored))
        return "token_truncate"
    return mode


TRL_DEFAULT_IS_MODE = "sequence_mask"  # GRPOConfig.vllm_importance_sampling_mode's default


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def turn_on_importance_sampling(trainer) -> None:
    """TRL runs its correction (and logs sampling/*) only when `use_vllm and vllm_importance_sampling_correction`.
    Setting use_vllm after TRL's __init__ starts no vLLM: TRL reads the flag only in the methods we replace
    (_generate_single_turn, the rollout_func branch of _generate, whose sync check we satisfy) and in the
    correction's checks. vllm_mode is set to a name no vLLM-only branch tests for ("colocate", "server")."""
    trainer.vllm_importance_sampling_mode = importance_sampling_mode(trainer)
    trainer.use_vllm = bool(trainer.vllm_importance_sampling_correction)
    trainer.vllm_mode = "rlspec_engine"


def masked_fractions(output: dict, mode: str) -> dict[str, float]:
    """What TRL's importance-sampling correction zeroed in one generation batch (`output`: what
    _generate_and_score_completions returns): the fraction of sequences that lost every token, and of completion
    tokens, under a *_mask mode (a *_truncate mode zeroes nothing). Logged as sampling/is_masked_*_frac: with the
    sampler in bf16 and the trainer in float32, a sequence-level mask drops whole samples (docs/sampling_dtype.md)."""
    ratio, mask = output["importance_sampling_ratio"], output["completion_mask"].bool()
    if "tool_mask" in output:
        mask = mask & output["tool_mask"].bool()
    if not mode.endswith("_mask"):
        return {"sampling/is_masked_sequence_frac": 0.0, "sampling/is_masked_token_frac": 0.0}
    zero = (ratio == 0).expand_as(mask) & mask  # a sequence ratio [B, 1] zeroes its whole row
    rows = mask.any(dim=1)
    dropped = ((zero.sum(dim=1) == mask.sum(dim=1)) & rows).sum()
    return {"sampling/is_masked_sequence_frac": float(dropped) / max(int(rows.sum()), 1),
            "sampling/is_masked_token_frac": float(zero.sum()) / max(int(mask.sum()), 1)}


def with_sampling_logprobs(rollout_func):
    """rollout_func, with `logprobs: None` in its output replaced by NaN per token (None, which TRL turns into
    NaN): TRL's correction gives NaN tokens a ratio of exactly 1, so a custom rollout that cannot score its
    tokens trains as in plain TRL, which runs no correction without vLLM."""
    if rollout_func is None:
        return None

    def rollout(prompts, trainer):
        output = rollout_func(prompts, trainer)
        if isinstance(output, dict) and output.get("logprobs", 0) is None and "completion_ids" in output:
            output = {**output, "logprobs": [[None] * len(ids) for ids in output["completion_ids"]]}
        return output

    rollout.__wrapped__ = rollout_func
    return rollout
