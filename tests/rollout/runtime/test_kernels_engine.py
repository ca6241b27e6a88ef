"""A bf16 engine with every Triton kernel of ours serving computes what the model computes, as closely as torch's ops
do: the few-rows products (forced, whatever their measured speed: q|k|v and gate|up with their norms inside, o with
the residual sum, down with SiLU times up inside and the residual sum, the LM head with the final norm), the
rotation with the KV writes, and on CUDA the paged attention, plain and with drafts verified through the same
kernels.

A unit test of one kernel does not reach the way the engine calls it (its strides, slots and row counts, a prefill,
a verify's rows, inside a graph); here whole rollouts do. Each token's logprob, as the engine reports it, is held
against the same bf16 weights computed in float32 by transformers over the engine's own tokens. bf16's rounding
puts the engine with torch's ops some distance from it; the engine through our kernels must be no further (they
round once where torch's ops round twice). A kernel that misreads a row, a slot, a bias or a norm moves the
logprobs by far more. tests/gpu/test_cuda_triton.py runs the same on CUDA with graphs; here Triton's interpreter
runs the kernels (TRITON_INTERPRET, tests/conftest.py)."""
from __future__ import annotations

import collections
import os

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import attention, fused_ops, llama, loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts

VOCAB = 256
KERNELS = ("normed", "residual", "gated", "rotation")  # what must have served: the products' kinds, the rotation


def bf16_model(device: str, seed: int = 7, **config):
    """A Qwen2-layout model in bf16 on `device`: q|k|v biases and norm weights (not HF's ones) that matter."""
    hf = make_tiny_hf("qwen2", seed=seed, vocab=VOCAB, **config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return hf.to(torch.bfloat16).to(device)


def force_our_kernels(monkeypatch, device: str) -> collections.Counter:
    """Every product of a few rows takes our kernel, and our kernels' calls are counted (the returned counter: the
    products by kind, the rotations, the paged attentions). Off CUDA, where none serves, they are made to: Triton's
    interpreter runs them."""
    counts: collections.Counter = collections.Counter()

    def counted(name, fn):
        return lambda *args: counts.update([name(*args) if callable(name) else name]) or fn(*args)

    def kind(x, weight, bias=None, residual=None, norm=None, eps=0.0, gated=False):
        return "gated" if gated else "normed" if norm is not None else "residual" if residual is not None else "plain"

    monkeypatch.setattr(fused_ops, "_faster_here", lambda key, ours, theirs: True)
    monkeypatch.setattr(fused_ops, "_fused_product", counted(kind, fused_ops._fused_product))
    monkeypatch.setattr(fused_ops, "_fused_rotation", counted("rotation", fused_ops._fused_rotation))
    monkeypatch.setattr(llama, "attend_paged", counted("attend_paged", llama.attend_paged))
    if device != "cuda":
        monkeypatch.setattr(fused_ops, "triton_serves", lambda t, errors: not errors and not torch.is_grad_enabled())
        monkeypatch.setattr(fused_ops, "_timed_here", lambda t: True)
        monkeypatch.setattr(llama, "fused_norm", lambda t, weight: not torch.is_grad_enabled())
    return counts


def rollouts(hf, prompts, new: int, reference=None, **engine_kw) -> tuple[list, RolloutEngine]:
    """The engine's greedy rollouts (EOS ignored); with `reference` (tokens per prompt), every step verifies a chain
    of 4 drafted from it, a third of the drafts corrupted: accepts, rejections and partial accepts."""
    from tests.rollout.spec_helpers import ScriptedDrafter
    from tests.rollout.test_engine_spec import _arm, oracle_from

    spec = drafter = None
    if reference is not None:
        spec = SpecConfig(drafter="ngram", num_draft_tokens=4, max_spec_batch=10_000, online_training=False)
        drafter = ScriptedDrafter(VOCAB, oracle_from(dict(enumerate(reference))), corrupt=0.3, seed=5)
    engine = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, drafter=drafter, eos_token_ids=[-1],
                           **engine_kw)
    if spec is not None:
        engine.speculation.force(_arm(engine))
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True))
    if spec is not None:
        assert drafter.multi > 0 and engine.stats()["rollout/accept_len"] > 1.0  # multi-token drafts verified
    return out, engine


def logprob_error(hf, results) -> float:
    """The largest gap between the engine's logprobs and the bf16 weights' own in float32 (transformers, the prompt
    and the engine's tokens teacher-forced)."""
    exact = hf.float()
    try:
        worst = 0.0
        with torch.no_grad():
            for r in results:
                ids = torch.tensor([r.prompt_ids + r.completion_ids], device=next(exact.parameters()).device)
                logp = exact(ids).logits[0, len(r.prompt_ids) - 1:-1].log_softmax(-1)
                want = logp.gather(-1, ids[0, len(r.prompt_ids):, None])[:, 0].cpu()
                worst = max(worst, (torch.tensor(r.logprobs) - want).abs().max().item())
        return worst
    finally:
        hf.to(torch.bfloat16)


def check_engine_through_our_kernels(monkeypatch, hf, speculate: bool, prompts, new: int,
                                     **engine_kw) -> tuple[collections.Counter, RolloutEngine]:
    """The engine with torch's ops (a paged step's attention on CUDA dense over its gathered blocks, the paged
    kernel's fallback), then through our kernels: the second's logprobs no further from the exact ones than the
    first's, within half as far again. Returns the kernels' call counts and the second engine."""
    device = next(hf.parameters()).device.type
    with monkeypatch.context() as torch_only:
        torch_only.setattr(fused_ops, "triton_serves", lambda t, errors: False)
        torch_only.setattr(llama, "attend_paged", attention.attend_paged_dense)
        torch_ops, _ = rollouts(hf, prompts, new, **engine_kw)
    reference = [r.completion_ids for r in torch_ops] if speculate else None
    counts = force_our_kernels(monkeypatch, device)
    ours, engine = rollouts(hf, prompts, new, reference, **engine_kw)
    assert all(counts[k] > 0 for k in KERNELS), counts
    assert not (fused_ops._product_error or fused_ops._rotation_error or fused_ops._silu_error)
    err_torch, err_ours = logprob_error(hf, torch_ops), logprob_error(hf, ours)
    assert err_ours <= max(err_torch, 2 ** -8) * 1.5, (err_ours, err_torch)
    return counts, engine


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter is off")
@pytest.mark.parametrize("speculate", [False, True])
def test_a_bf16_engine_through_our_kernels_is_as_exact_as_torchs_ops(monkeypatch, speculate):
    pytest.importorskip("triton")
    # the interpreter runs a program in ~30 ms: one layer, two rows, a few steps; the fused CPU step (a C++ op a
    # layer, model/fused.py) is what compile_mode="off" leaves out
    hf, prompts = bf16_model("cpu", num_hidden_layers=1), random_prompts(2, 4, 12, seed=2, vocab=VOCAB)
    counts, _ = check_engine_through_our_kernels(monkeypatch, hf, speculate, prompts, 8, compile_mode="off")
    assert attention.use_paged_decode("cpu") is False and counts["attend_paged"] == 0  # CUDA's (tests/gpu)
