"""probs_from_logits decides exactly like transformers' processors (repetition penalty, temperature,
top-k, top-p, min-p).

The reference is RepetitionPenaltyLogitsProcessor -> TemperatureLogitsWarper -> TopKLogitsWarper ->
TopPLogitsWarper -> MinPLogitsWarper (generate's order, min_tokens_to_keep=1) then a softmax. Equality
is exact (torch.equal), ties and top-p boundaries included: an earlier version that kept tokens while the descending "mass before" stayed under top_p
agreed in exact arithmetic but kept a different one of tied tokens and rounded differently at the
boundary (e.g. ten tokens of 0.1 with top_p 0.6: 7 kept instead of HF's 6).
"""
import itertools

import pytest
import torch

from rlspec.rollout.runtime.history import TokenHistory
from rlspec.rollout.runtime.sampling import greedy_tokens, penalise, probs_from_logits
from rlspec.rollout.types import SamplingParams
from tests.rollout.law_helpers import hf_warpers


def hf_probs(logits: torch.Tensor, params: SamplingParams, ids: torch.Tensor | None = None) -> torch.Tensor:
    return torch.softmax(hf_warpers(params)(ids, logits.clone()), -1)


def seen_of(ids: torch.Tensor, V: int) -> torch.Tensor:
    """[R, L] token ids -> [R, V] bool presence, built independently of TokenHistory."""
    return torch.zeros(ids.shape[0], V, dtype=torch.bool).scatter_(1, ids, True)


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


@pytest.mark.parametrize("case", sorted(_cases()))
def test_penalty_and_min_p_match_transformers_exactly(case):
    """Repetition penalty over a random history (repeats included, penalties above and below 1) and
    min-p at and around its boundaries, combined with temperature, top-k and top-p."""
    logits = _cases()[case]
    R, V = logits.shape
    ids = torch.randint(0, V, (R, 6), generator=torch.Generator().manual_seed(2))
    seen = seen_of(ids, V)
    settings = itertools.product((1.0, 1.3, 0.8), (1.0, 0.7), (0, 3, V), (1.0, 0.9, 0.5),
                                 (0.0, 0.05, 0.2, 0.5, 1.0))
    for pen, t, k, p, m in settings:
        params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=pen)
        ours, ref = probs_from_logits(logits, params, seen), hf_probs(logits, params, ids)
        assert torch.equal(ours, ref), (case, pen, t, k, p, m, (ours - ref).abs().max())


def test_min_p_boundary_ties():
    """min-p keeps a token whose probability equals min_p x the top one exactly (HF drops only '<'), and
    every token tied with the top one."""
    logits = torch.log(torch.tensor([[0.4, 0.4, 0.1, 0.1], [0.5, 0.25, 0.125, 0.125]]))
    for m in (0.25, 0.5, 1.0):
        params = SamplingParams(min_p=m)
        assert torch.equal(probs_from_logits(logits, params), hf_probs(logits, params))
    assert (probs_from_logits(logits, SamplingParams(min_p=0.25))[1] > 0).tolist() == [True, True, True, True]


def test_greedy_with_penalty_matches_transformers():
    """Temperature 0: generate applies only the processors, so the token is the penalised argmax."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(500, 20, generator=g) * 2
    ids = torch.randint(0, 20, (500, 5), generator=g)
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    ref = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone()).argmax(-1)
    got = greedy_tokens(logits, seen_of(ids, 20), params)
    assert torch.equal(got, ref)
    assert not torch.equal(got, logits.argmax(-1))  # the penalty changed some argmaxes: the test can tell


def _ancestors(parents: list[int], j: int) -> list[int]:
    """Draft indices on the path from the root to draft j, j included."""
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out


@pytest.mark.parametrize("tree", [False, True])
def test_node_histories_are_the_path_to_each_node(tree):
    """TokenHistory.at_nodes: node 0 (pending) sees the row's tokens; draft node j+1 also sees the drafts
    on its path, itself included, and nothing from other branches. Checked against HF's penalty applied
    to each node's explicit history (row tokens + path), which is what the verify's p must equal."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from rlspec.rollout.speculation.draft_batch import build_draft_batch
    from rlspec.rollout.speculation.drafters.base import Draft

    V, g = 12, torch.Generator().manual_seed(4)
    rows = [[3, 4, 4, 9], [1, 2], [7]]
    parents = [-1, -1, 0, 1, 2] if tree else [-1, 0, 1, 2, 3]
    drafts = [Draft([5, 6, 7, 3, 8], parents), Draft([2, 2, 9], parents[:3] if tree else [-1, 0, 1]), Draft()]
    batch = build_draft_batch([r[-1] for r in rows], drafts)
    assert batch.is_chain == (not tree)
    h = TokenHistory(4, V, "cpu")
    h.reset([0, 1, 2], rows)
    seen = h.at_nodes(batch.tokens, batch.tree_mask)
    logits = torch.randn(3, batch.tokens.shape[1], V, generator=g)
    params = SamplingParams(repetition_penalty=1.7)
    got = penalise(logits, seen, params)
    for b, (r, d) in enumerate(zip(rows, drafts)):
        for node in range(len(d) + 1):
            path = [] if node == 0 else [d.tokens[j] for j in _ancestors(d.parents, node - 1)]
            ids = torch.tensor([r + path])
            ref = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[b, node][None].clone())[0]
            assert torch.equal(got[b, node], ref), (b, node)


def test_history_follows_marks_and_row_moves():
    h = TokenHistory(3, 8, "cpu")
    h.reset([0, 1, 2], [[1], [2], [3]])
    h.mark(torch.arange(3), torch.tensor([[4, 5], [6, 7], [0, 0]]), torch.tensor([[True, False], [True, True],
                                                                                 [False, False]]))
    h.move_rows([2], [0])  # row 0 finished; row 2's sequence moves down
    assert h.rows(torch.arange(2)).nonzero().tolist() == [[0, 3], [1, 2], [1, 6], [1, 7]]
