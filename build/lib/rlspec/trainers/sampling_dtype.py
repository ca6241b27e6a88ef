"""The dtype rollouts are sampled in: the trainer's compute dtype, not its master weights' storage dtype.

A TRL user trains a float32 model under mixed precision (`bf16=True`): the optimizer keeps float32 master
weights and every forward runs in bf16. vLLM, which TRL's users sample with, loads the policy in the 16-bit
dtype of that run, and TRL's importance-sampling correction covers the difference between the sampler's
logprobs and the trainer's. Sampling in the storage dtype instead would cost the float32 step (on the CPU
~4x a bf16 step of the engine, docs/runtime.md) for no gain in what the trainer computes. So every backend
(the engine, a Ray pool of engines, vLLM) samples in:

1. the dtype the user asked for (`engine_kwargs["dtype"]`, the run config's `dtype`), else
2. bfloat16 under `bf16=True`, float16 under `fp16=True`, else
3. the model config's own 16-bit dtype (`config.dtype`, a checkpoint saved in bf16), else
4. the policy's decoder-layer dtype (a float32 model trained in float32 samples in float32).

On a CPU without native support for the chosen 16-bit type (no AVX512-BF16/AMX, where oneDNN emulates it and
the step is slower than float32) the engine samples in float32 instead, said once in the log.
`cast_lm_head_to_fp32` (TRL's ScaleRL option) keeps the LM head in float32 over the 16-bit body, as TRL's
own forward does, so the sampler's logits come from the same product the trainer recomputes.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def as_dtype(value) -> torch.dtype:
    """A torch dtype from a dtype or its name ("bfloat16", "bf16", "float32", ...)."""
    if isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.")
    if key not in _NAMES:
        raise ValueError(f"unknown sampling dtype {value!r}: use one of bfloat16, float16, float32")
    return _NAMES[key]


def config_dtype(policy) -> torch.dtype | None:
    """The 16-bit dtype the model's config declares (transformers 5: `dtype`; older: `torch_dtype`), else None."""
    config = getattr(policy, "config", None)
    for key in ("dtype", "torch_dtype"):
        value = getattr(config, key, None)
        if value is not None:
            try:
                dtype = as_dtype(value)
            except ValueError:
                return None
            return dtype if dtype in _SIXTEEN_BIT else None
    return None


def compute_dtype(args, policy, body_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """(dtype, why) by rules 2-4 of the module docstring, for TrainingArguments-like `args` (bf16, fp16)."""
    if getattr(args, "bf16", False):
        return torch.bfloat16, "bf16=True"
    if getattr(args, "fp16", False):
        return torch.float16, "fp16=True"
    declared = config_dtype(policy)
    if declared is not None:
        return declared, f"the model config's dtype {str(declared).removeprefix('torch.')}"
    return body_dtype, "the policy's own dtype"


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` natively (oneDNN's own check: AVX512-BF16/AMX, AVX512-FP16)."""
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        return bool(mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(mkldnn._is_mkldnn_fp16_supported())
    return True


def sampling_dtype(args, policy, requested=None, device: torch.device | str | None = None,
                   body_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype a trainer's rollout backend samples in (module docstring). `requested`: the user's explicit
    choice, which always wins; `device`: where the engine runs (a CPU may downgrade a 16-bit choice);
    `body_dtype`: the policy's decoder-layer dtype (default: its first parameter's)."""
    if requested is not None:
        return as_dtype(requested)
    if body_dtype is None:
        body_dtype = next(policy.parameters()).dtype
    dtype, why = compute_dtype(args, policy, body_dtype)
    device = torch.device(device) if device is not None else next(policy.parameters()).device
    if device.type == "cpu" and dtype in _SIXTEEN_BIT and not cpu_supports(dtype):
        logger.warning("rlspec: this CPU has no native %s arithmetic (it would be emulated, slower than float32): "
                       "rollouts are sampled in float32 instead of %s (%s); pass engine_kwargs={'dtype': ...} "
                       "to choose", dtype, dtype, why)
        return torch.float32
    if dtype != body_dtype:
        logger.info("rlspec: rollouts are sampled in %s (%s) from %s master weights; TRL's importance-sampling "
                    "correction sees the sampler's logprobs. engine_kwargs={'dtype': 'float32'} samples in float32",
                    str(dtype).removeprefix("torch."), why, str(body_dtype).removeprefix("torch."))
    return dtype


def head_dtype(args) -> torch.dtype | None:
    """float32 when TRL's cast_lm_head_to_fp32 is on (the engine then keeps its LM head in float32), else None."""
    return torch.float32 if getattr(args, "cast_lm_head_to_fp32", False) else None
