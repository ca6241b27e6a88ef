"""The arithmetic of reading vLLM's draft model back after a push (rollout/vllm_backend/drafter_readback.py),
without vLLM: real torch modules in vLLM's layout (q/k/v fused into one tensor, an embedding shared with the
target, a buffer-like tensor the export never sends) behind `collective_rpc`, the one call it makes. vLLM's own
draft model is read in tests/vllm (make test-vllm)."""
from __future__ import annotations

import torch
from torch import nn

from rlspec.rollout.speculation.drafter_health import DrafterHealth, fingerprint
from rlspec.rollout.vllm_backend.drafter_readback import DraftReadback


class _Runner:
    def __init__(self, target: nn.Module, draft: nn.Module):
        self.target, self.draft = target, draft

    def get_model(self):
        return self.target

    def get_draft_model(self):
        return self.draft


class _LLM:
    """An object with vLLM's `collective_rpc(fn)`: fn runs on the (one) worker, results come back as a list."""

    def __init__(self, runner):
        self.worker = type("Worker", (), {"model_runner": runner})()

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]


def exported(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, shape in
            {"q.weight": (8, 4), "k.weight": (4, 4), "v.weight": (4, 4), "fc.weight": (4, 12)}.items()}


def held_layout(tensors: dict, embed: nn.Embedding) -> nn.Module:
    """The draft model as vLLM lays it out: qkv fused, the target's embedding shared, an extra tensor."""
    m = nn.Module()
    m.qkv = nn.Parameter(torch.cat([tensors["q.weight"], tensors["k.weight"], tensors["v.weight"]]).bfloat16())
    m.fc = nn.Parameter(tensors["fc.weight"].bfloat16())
    m.embed = embed
    m.extra = nn.Parameter(torch.full((5,), 3.0))  # never sent: measured once at start, taken off after
    return m


def test_a_push_read_back_through_fused_and_shared_tensors():
    target = nn.Module()
    target.embed = nn.Embedding(10, 4)
    v0, v1 = exported(0), exported(1)
    draft = held_layout(v0, target.embed)
    llm = _LLM(_Runner(target, draft))
    readback = DraftReadback(llm, v0)
    health = DrafterHealth(backend="vllm")
    # v1 lands intact (fused, in bf16): it passes
    draft.qkv.data = torch.cat([v1["q.weight"], v1["k.weight"], v1["v.weight"]]).bfloat16()
    draft.fc.data = v1["fc.weight"].bfloat16()
    assert health.pushed(1, fingerprint(v1), {"vllm": readback.held(llm)}, by_name=False)
    with torch.no_grad():
        target.embed.weight.mul_(2)  # a policy sync moves the shared embedding: not the drafter's business
    assert health.pushed(1, fingerprint(v1), {"vllm": readback.held(llm)}, by_name=False)
    # a fresh drafter (v2, trained from scratch) whose fc never arrived (vLLM's load skips a name it does not know):
    # v1's fc is still in use. By totals in bf16 a whole tensor's change shows, one optimizer step's would not.
    v2 = exported(2)
    draft.qkv.data = torch.cat([v2["q.weight"], v2["k.weight"], v2["v.weight"]]).bfloat16()
    assert not health.pushed(2, fingerprint(v2), {"vllm": readback.held(llm)}, by_name=False)
    assert "(all tensors): values differ" in health.reason
