"""The CPU sampling kernels draw the laws they claim: rlspec_kernels::sample_rows (a row's softmax) and
rlspec_kernels::verify_chain_rows (the chain rule of speculative sampling), each against the law computed in
float64 apart from it, at the suite's threshold ALPHA (tests/rollout/law_helpers.py).

Each law test has a table of known-wrong variants run through the same kernel, the same draws and the same
test: a flaw perturbs the kernel's inputs the way the wrong variant would (a shifted vocabulary, another
temperature, a block of logits never read, one uniform reused, the bonus read from the wrong position), or
swaps its output for the wrongly computed one at the call site (a residual drawn from p). Every flaw must fail
the law test: this is what shows it has the power to see them.
"""
import math

import pytest
import torch

from rlspec.rollout.runtime.model import kernels
from tests.rollout.law_helpers import ALPHA, chi2_pvalue

needs_kernel = pytest.mark.skipif(not kernels.draws_available(), reason="no C++ toolchain")
V, N = 1000, 40000


# ---- sample_rows ---------------------------------------------------------------------------------------
def _row_case(temperature: float):
    """(logits [V], uniforms [N], exact law [V] float64): one row spread over ~6 nats, every 7th token at a
    logit whose exp underflows to exactly 0 (never drawn)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(V, generator=g) * 1.5
    x[::7] = -300.0
    return x, torch.rand(N, generator=g), torch.softmax(x.double() / temperature, -1)


def _sample(x, r, temperature):
    return torch.ops.rlspec_kernels.sample_rows(x.expand(len(r), -1).contiguous(), r, temperature)


SAMPLE_FLAWS = {  # name -> (logits, uniforms, temperature) -> what the wrong variant draws
    "token_off_by_one": lambda x, r, t: _sample(x.roll(1), r, t),
    "temperature_10pc_off": lambda x, r, t: _sample(x, r, t * 1.1),
    "block_of_16_never_read": lambda x, r, t: _sample(torch.cat([x[:496], torch.full((16,), -300.0), x[512:]]), r, t),
}


@needs_kernel
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_rows_draws_the_softmax_with_its_logprob(temperature):
    """40000 draws of one row against its float64 softmax (every cell kept: rare ones pooled, a draw of a token of
    probability 0 fails), the logprob of each drawn token, and rows with a NaN or an inf flagged."""
    x, r, law = _row_case(temperature)
    tok, row = _sample(x, r, temperature)
    lp, fin = row[:, 1], row[:, 2]
    assert tok.dtype == torch.long and row.dtype == torch.float64 and (fin == 0).all()
    assert torch.equal(row[:, 0], tok.double())  # the step's transfer row: [token, logprob, finite column]
    assert not (tok % 7 == 0).any()
    assert chi2_pvalue(torch.bincount(tok, minlength=V), law) > ALPHA
    torch.testing.assert_close(lp.double(), torch.log_softmax(x.double() / temperature, -1)[tok], atol=2e-5, rtol=0)
    bad = torch.stack([x, x, x])
    bad[0, 5], bad[2, 900] = float("nan"), float("inf")
    assert torch.ops.rlspec_kernels.sample_rows(bad, r[:3], temperature)[1][:, 2].tolist() == [-math.inf, 0, -math.inf]


@needs_kernel
@pytest.mark.parametrize("flaw", list(SAMPLE_FLAWS))
def test_sample_rows_flaws_fail_the_law_test(flaw):
    x, r, law = _row_case(0.7)
    tok = SAMPLE_FLAWS[flaw](x, r, 0.7)[0]
    assert chi2_pvalue(torch.bincount(tok, minlength=V), law) <= ALPHA


# ---- verify_chain_rows ---------------------------------------------------------------------------------
K, VC, T = 2, 12, 0.8


def _chain_case(sampled: bool):
    """Two drafts verified on N identical rows -> (inputs of verify_chain_rows, the law [(K + 1) * VC] of
    (drafts accepted, next token)): P(0, t) = (1 - a0) res0(t), P(1, t) = a0 (1 - a1) res1(t),
    P(2, t) = a0 a1 p2(t), a_i = min(1, p_i(x_i) / q_i(x_i)), res_i = norm(max(0, p_i - q_i)), q sampled (more
    mass than p on each draft, the rest spread elsewhere) or one-hot at the draft."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, K + 1, VC, generator=g) * 1.5
    p = torch.softmax(logits.double() / T, -1)[0]
    x = p[:K].argsort(-1, descending=True)[None, :, 1]  # each draft the second likeliest token
    if sampled:
        q = torch.softmax(torch.randn(1, K, VC, generator=g) * 1.5, -1)
        q = q.scatter_add(-1, x[..., None], 2 * p[:K].gather(-1, x[0][:, None]).float()[None])
        q = q / q.sum(-1, keepdim=True)
    else:
        q = torch.zeros(1, K, VC).scatter_(-1, x[..., None], 1.0)
    q64 = q[0].double()
    a = [min(1.0, float(p[i, x[0, i]] / q64[i, x[0, i]])) for i in range(K)]
    res = [(p[i] - q64[i]).clamp(min=0) / (p[i] - q64[i]).clamp(min=0).sum() for i in range(K)]
    law = torch.stack([(1 - a[0]) * res[0], a[0] * (1 - a[1]) * res[1], a[0] * a[1] * p[2]]).reshape(-1)
    assert 0.1 < a[0] < 0.9 and 0.1 < a[1] < 0.9  # every outcome is frequent
    u, r = torch.rand(N, K, generator=g), torch.rand(N, generator=g)
    inputs = dict(logits=logits.expand(N, -1, -1).contiguous(), x=x.expand(N, -1), num=torch.full((N,), K),
                  q=q.expand(N, -1, -1).contiguous() if sampled else torch.empty(0), u=u, r=r)
    return inputs, law


def _verify(logits, x, num, q, u, r):
    return torch.ops.rlspec_kernels.verify_chain_rows(logits, x, num, q, u, r, T)


def _residual_from_p(logits, x, num, q, u, r):
    """After a rejection the next token drawn from p (by the kernel's own uniform r), not from the residual."""
    acc, tok, row = _verify(logits, x, num, q, u, r)
    cdf = torch.softmax(logits.double() / T, -1)[torch.arange(len(acc)), acc].cumsum(-1)
    from_p = torch.searchsorted(cdf, (r.double() * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=VC - 1)
    return acc, torch.where(acc < num, from_p, tok), row


VERIFY_FLAWS = {  # name -> the kernel called as the wrong variant would be
    "residual_from_p": _residual_from_p,
    "one_uniform_for_both_tests": lambda logits, x, num, q, u, r: _verify(logits, x, num, q,
                                                                          u[:, :1].expand(-1, K).contiguous(), r),
    "lenient_acceptance_1.1": lambda logits, x, num, q, u, r: _verify(logits, x, num, q, u / 1.1, r),
    "bonus_from_p1": lambda logits, x, num, q, u, r: _verify(torch.cat([logits[:, :2], logits[:, 1:2]], 1).contiguous(),
                                                             x, num, q, u, r),
}


def _chain_pvalue(acc, tok, law) -> float:
    return chi2_pvalue(torch.bincount(acc * VC + tok, minlength=(K + 1) * VC), law)


@needs_kernel
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "one-hot-q"])
def test_verify_chain_rows_has_the_chain_rules_law(sampled):
    """40000 rows verifying the same two drafts: their (drafts accepted, next token) against the chain rule's law,
    and each row's host transfer (step_layout.py): the accepted count, the emitted tokens, their logprobs, and the
    finite flag over the positions used only."""
    inputs, law = _chain_case(sampled)
    acc, tok, row = _verify(**inputs)
    assert row.dtype == torch.float64 and row.shape == (N, 2 * K + 4)
    assert (row[:, -1] == 0).all() and _chain_pvalue(acc, tok, law) > ALPHA
    logits, x = inputs["logits"][:1], inputs["x"][:1]
    emitted = torch.cat([x.expand(N, -1), torch.zeros(N, 1, dtype=torch.long)], 1)
    emitted = emitted.scatter(1, acc[:, None], tok[:, None])
    want = torch.log_softmax(logits.double() / T, -1)[0].gather(1, emitted.t()).t()  # [N, K + 1]
    used = torch.arange(K + 1)[None, :] <= acc[:, None]
    assert torch.equal(row[:, 0], acc.double())
    assert torch.equal(row[:, 1:K + 2][used], emitted.double()[used])
    torch.testing.assert_close(row[:, K + 2:2 * K + 3][used], want[used], atol=2e-5, rtol=0)

    bad = logits.expand(3, -1, -1).clone()
    bad[0, 0, 5], bad[1, 2, 1], bad[2, 1, 0] = float("nan"), float("inf"), float("nan")
    u3 = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1 - 1e-7, 0.0]])  # rows 0 and 1 accept all, row 2 rejects at 0
    q3 = inputs["q"][:3] if sampled else inputs["q"]
    out = _verify(bad, x.expand(3, -1), torch.full((3,), K), q3, u3, inputs["r"][:3])
    assert out[2][:, -1].tolist() == [-math.inf, -math.inf, 0]  # row 2 never reads position 1


@needs_kernel
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "one-hot-q"])
@pytest.mark.parametrize("flaw", list(VERIFY_FLAWS))
def test_verify_chain_rows_flaws_fail_the_law_test(flaw, sampled):
    inputs, law = _chain_case(sampled)
    acc, tok, *_ = VERIFY_FLAWS[flaw](**inputs)
    assert _chain_pvalue(acc, tok, law) <= ALPHA
