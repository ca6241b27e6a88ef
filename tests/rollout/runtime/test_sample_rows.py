"""A plain step's draw in two Triton kernels (model/sample_rows.py), the CUDA twin of the CPU op sample_rows: for
every uniform, the token is the inverse of softmax(logits / T)'s CDF at 1 - r computed in float64 apart from the
kernels (so its law is the softmax's), never a token of mass 0, its logprob the float64 log-softmax, and a row with a
NaN or an inf flagged; rows split in one chunk, a few, or as many as a 152k vocabulary gives. Known-wrong variants
fail the same check. Then a rollout drawing through the kernels is the rollout of torch's draw, token for token. On
CUDA compiled; elsewhere through Triton's interpreter (TRITON_INTERPRET, tests/conftest.py)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from rlspec.rollout.runtime import sampling

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before triton is imported)", allow_module_level=True)
kernel = pytest.importorskip("rlspec.rollout.runtime.model.sample_rows", reason="needs triton")


def _case(B: int, V: int, seed: int = 0):
    """Logits [B, V] spread over ~6 nats with every 7th token at -300 (mass exactly 0 at float32), and r [B] over
    [0, 1) with both ends: r = 0 (u = 1: the last token with mass) and u = 2^-24 (the first)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 1.5
    x[:, ::7] = -300.0
    r = torch.rand(B, generator=g)
    r[0], r[1] = 0.0, 1.0 - 2.0 ** -24
    return x, r


def _exact(x: torch.Tensor, r: torch.Tensor, temperature: float):
    """(tokens, whether each lies within float32 rounding of a CDF boundary, log-softmax) in float64."""
    p = torch.softmax(x.double() / temperature, -1)
    cdf = p.cumsum(-1)
    target = (1 - r.double())[:, None] * cdf[:, -1:]
    tok = torch.searchsorted(cdf, target).clamp(max=x.shape[1] - 1).squeeze(1)
    # a draw whose target lies this close to the cumulative mass at the token's start or end may round either way
    near = ((cdf.gather(1, tok[:, None]) - target).abs() < 1e-5) | \
        ((cdf.gather(1, (tok - 1).clamp(min=0)[:, None]) - target).abs() < 1e-5)
    return tok, near.squeeze(1), torch.log_softmax(x.double() / temperature, -1)


def _check(x, r, temperature, tok, row) -> list[str]:
    """What is wrong with a draw (empty: the inverse CDF at every uniform not at a boundary)."""
    want, near, logp = _exact(x, r, temperature)
    wrong = []
    if not torch.equal(row[:, 0], tok.double()):
        wrong.append("the row's token column is not the token")
    if (x.gather(1, tok[:, None]) == -300.0).any():
        wrong.append("a token of mass 0 drawn")
    off = (tok != want) & ~near
    if off.any():
        wrong.append(f"{int(off.sum())} of {len(tok)} tokens off the inverse CDF")
    lp = row[:, 1]
    if not torch.allclose(lp, logp.gather(1, tok[:, None]).squeeze(1), atol=1e-4, rtol=0):
        wrong.append("logprobs off")
    return wrong


def _draw(x, r, temperature, programs=None):
    return kernel.sample_rows(x.to(DEVICE), r.to(DEVICE), temperature, programs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("programs", [1, 64, 128])  # one chunk a row, two (64 rows), three (128: every block)
def test_the_draw_inverts_the_cdf_at_every_uniform(temperature, programs):
    x, r = _case(64, 5000)
    assert kernel.chunks(64, 5000, programs) == {1: (1, 6144), 64: (1, 6144), 128: (2, 4096)}[programs]
    tok, row = (t.cpu() for t in _draw(x, r, temperature, programs))
    assert tok.dtype == torch.long and row.dtype == torch.float64 and row.shape == (64, 3)
    assert _check(x, r, temperature, tok, row) == []
    assert (row[:, 2] == 0).all()
    assert tok[0] == max(i for i in range(5000) if i % 7) and tok[1] == 1  # u = 1: the last with mass; u ~ 0: the first


def test_a_row_of_qwens_vocabulary_in_many_chunks():
    """152,064 logits a row (Qwen2.5's vocabulary), two rows split into 75 chunks of one block each."""
    x, r = _case(2, 152064, seed=3)
    assert kernel.chunks(2, 152064, 264) == (75, 2048)
    tok, row = (t.cpu() for t in _draw(x, r, 1.0))
    assert _check(x, r, 1.0, tok, row) == []
    x, r = _case(8, 152064, seed=4)
    tok, row = (t.cpu() for t in _draw(x, r, 1.0, programs=16))  # 2 chunks of 38 blocks: the scan walks blocks
    assert _check(x, r, 1.0, tok, row) == []


def test_rows_with_a_nan_or_an_inf_are_flagged():
    x, r = _case(4, 3000)
    x[0, 5], x[2, 2900], x[3, 100] = float("nan"), float("inf"), -float("inf")
    _, row = _draw(x, r, 1.0, programs=8)
    assert row[:, 2].cpu().tolist() == [-math.inf, 0.0, -math.inf, -math.inf]


FLAWS = {  # name -> what a wrong variant would draw, through the same kernels
    "token_off_by_one": lambda x, r, t: _draw(x.roll(1, 1), r, t),
    "temperature_10pc_off": lambda x, r, t: _draw(x, r, t * 1.1),
    "u_not_1_minus_r": lambda x, r, t: _draw(x, 1 - r - 2.0 ** -24, t),
    "block_never_read": lambda x, r, t: _draw(torch.cat([x[:, :2048], torch.full((len(x), 2048), -300.0),
                                                         x[:, 4096:]], 1), r, t, programs=128),
}


@pytest.mark.parametrize("flaw", sorted(FLAWS))
def test_wrong_variants_fail_the_check(flaw):
    x, r = _case(64, 5000, seed=1)
    tok, row = (t.cpu() for t in FLAWS[flaw](x, r, 0.7))
    assert _check(x, r, 0.7, tok, row) != []


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32 logits"):
        kernel.sample_rows(torch.zeros(2, 8, dtype=torch.float16, device=DEVICE), torch.zeros(2, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="r \\[B\\]"):
        kernel.sample_rows(torch.zeros(2, 8, device=DEVICE), torch.zeros(3, device=DEVICE), 1.0)


def test_a_rollout_through_the_kernels_is_torchs_token_for_token(monkeypatch, tiny_hf):
    """The engine's plain steps drawn by the kernels (sampling.device_draws, forced on CPU tensors here) against the
    same rollout drawn by torch's ops: the same tokens under per-sample keys, logprobs to float32 rounding, and the
    kernels did draw."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.types import SamplingParams
    from tests.conftest import random_prompts

    calls = []
    real = kernel.sample_rows
    monkeypatch.setattr(kernel, "sample_rows", lambda *a: calls.append(1) or real(*a))
    params = SamplingParams(temperature=0.8, max_new_tokens=12, ignore_eos=True, seed=0)
    prompts = random_prompts(3, seed=5)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(sampling, "kernel_draws", lambda logits, p: False)
        monkeypatch.setattr(sampling, "device_draws", lambda logits, p, on=on: on and not p.greedy)
        engine = RolloutEngine(loader.from_hf_model(tiny_hf), None, max_num_seqs=4, max_model_len=64)
        outs.append(engine.generate(prompts, params, sample_keys=[11, 12, 13]))
    assert calls and len(outs[0]) == 3
    for torch_out, ours in zip(*outs):
        assert ours.completion_ids == torch_out.completion_ids
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(torch_out.logprobs), atol=1e-5, rtol=0)


def test_a_failing_kernel_warns_once_and_torch_draws_from_then_on(monkeypatch):
    monkeypatch.setattr(sampling, "_draw_error", [])
    monkeypatch.setattr(sampling, "_device_sample_rows", sampling.with_fallback(
        lambda *a: 1 / 0, sampling.torch_sample_rows, sampling._draw_error, "the Triton draw kernels", "torch's"))
    monkeypatch.setattr(sampling, "kernel_draws", lambda logits, p: False)
    monkeypatch.setattr(sampling, "triton_available", lambda: True)
    x, r = _case(4, 300)
    cuda_like = type("Logits", (), {})  # device_draws reads is_cuda and dtype only
    fake = cuda_like()
    fake.is_cuda, fake.dtype, fake.shape = True, torch.float32, x.shape
    params = sampling.SamplingParams(temperature=1.0)
    assert sampling.device_draws(fake, params)
    with pytest.warns(RuntimeWarning, match="Triton draw kernels"):
        tok, row = sampling._device_sample_rows(x, r, 1.0)
    assert torch.equal((tok, row)[0], sampling.torch_sample_rows(x, r, 1.0)[0])
    assert not sampling.device_draws(fake, params)  # torch's from now on
