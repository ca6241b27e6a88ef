"""probs_from_logits decides exactly like transformers' warpers (temperature, top-k, top-p).

The reference is TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper (generate's order,
min_tokens_to_keep=1) then a softmax. Equality is exact (torch.equal), ties and top-p boundaries
included: an earlier version that kept tokens while the descending "mass before" stayed under top_p
agreed in exact arithmetic but kept a different one of tied tokens and rounded differently at the
boundary (e.g. ten tokens of 0.1 with top_p 0.6: 7 kept instead of HF's 6).
"""
import itertools

import pytest
import torch

from rollout.runtime.sampling import probs_from_logits
from rollout.types import SamplingParams
from tests.rollout.law_helpers import hf_warpers


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return torch.softmax(hf_warpers(params)(None, logits.clone()), -1)


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "random": torch.randn(300, 32, generator=g) * 2,
        "ties": torch.randn(300, 16, generator=g).round(),  # many exactly equal logits
        "uniform": torch.zeros(3, 10),
        "tenths": torch.log(torch.full((2, 10), 0.1)),  # cumulative sums land on the top-p boundary
        "pair_tie": torch.tensor([[1.0, 1.0, 0.0, 0.0, -1.0]]),
        "masked": torch.tensor([[2.0, float("-inf"), 1.0, float("-inf"), 0.5, 0.0]]),  # a drafter's off-vocab
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_probs_match_transformers_warpers_exactly(case):
    logits = _cases()[case]
    V = logits.shape[-1]
    settings = itertools.product((1.0, 0.7, 1.3), (0, 1, 2, 3, 5, V - 1, V, V + 4),
                                 (1.0, 0.95, 0.9, 0.7, 0.6, 0.5, 0.3, 0.1))
    for t, k, p in settings:
        params = SamplingParams(temperature=t, top_k=k, top_p=p)
        ours, ref = probs_from_logits(logits, params), hf_probs(logits, params)
        assert torch.equal(ours, ref), (case, t, k, p, (ours - ref).abs().max())


def test_leading_dims_are_batch_dims():
    """The verifier passes [B, K+1, V]; HF's warpers take [B, V]: same answer row by row."""
    logits = torch.randn(4, 5, 12, generator=torch.Generator().manual_seed(1)).round()
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.7)
    assert torch.equal(probs_from_logits(logits, params), hf_probs(logits.view(20, 12), params).view(4, 5, 12))
