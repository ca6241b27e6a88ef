"""The torch expansion that replaces vLLM's CPU kernel (rollout/vllm_backend/cpu_fixes.py): vLLM's contract,
float values kept (the CPU kernel truncated them to integers and never wrote its float output)."""
from __future__ import annotations

import torch

from rlspec.rollout.vllm_backend.cpu_fixes import expand_batch_to_tokens


def test_expand_repeats_each_request_over_its_tokens_and_replaces():
    x = torch.tensor([0.7, -1.0, 1.3, 0.25])
    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)  # request 2 drafted nothing
    out = expand_batch_to_tokens(x, cu, 6, replace_from=-1, replace_to=1)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 0.25]))
    ints = expand_batch_to_tokens(torch.tensor([5, 0], dtype=torch.int32), torch.tensor([1, 3]), 3)
    assert ints.dtype == torch.int32 and ints.tolist() == [5, 0, 0]
