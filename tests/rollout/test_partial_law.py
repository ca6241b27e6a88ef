"""Partial rollouts in the engine (rollout/partial.py): a carried sample's law and its records.

A round stops after one decode step, so every sample holds exactly two tokens drawn from policy A; the weights
change to policy B and a second round continues each sample for two more tokens. The law of the four tokens is
then pA(x1) pA(x2|x1) pB(x3|x1 x2) pB(x4|x1..x3), computed here with transformers' own forward, independently of
the engine. Checked three ways, as the lossy law tests do:
  - the samples' frequencies fit that law (chi-square over every sequence, rare cells pooled, never dropped);
  - every recorded logprob equals the log-probability, under the policy that drew it, of its token;
  - the law the records claim (exp of the summed recorded logprobs) fits the frequencies, and the same test
    rejects records that give the prefix the newer policy's probabilities: the gate partial rollouts need.
The continuation also runs speculatively (a suffix drafter, multi-token drafts asserted) and must keep the law.
"""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import Carried, PartialRound, SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf
from tests.rollout.law_helpers import (ALPHA, _check_margins, chi2_pvalue, hf_warpers, make_law_model,  # noqa: F401
                                       one_thread, sequence_pvalue)

V, N, PROMPT = 6, 12000, [1, 3, 4]
pytestmark = pytest.mark.usefixtures("one_thread")


def policies():
    return make_law_model(vocab=V, seed=0, std=0.4), make_law_model(vocab=V, seed=1, std=0.4)


def two_rounds(spec_second: SpecConfig | None, **sampling):
    """(samples [N, 4], recorded logprobs [N, 4], the second round's engine stats). sampling: SamplingParams'
    temperature, top_k, top_p (default: temperature 1, no truncation)."""
    a, b = policies()
    first = RolloutEngine(loader.from_hf_model(a), None, eos_token_ids=[], max_num_seqs=N)
    params = SamplingParams(**{"temperature": 1.0, **sampling}, max_new_tokens=4, seed=3)
    out = first.generate([PROMPT], params, partial=PartialRound([[None] * N], stop_after_groups=0, min_decode_steps=1))
    assert all(r.finish_reason == "partial" and len(r.completion_ids) == 2 for r in out)
    if spec_second is None:  # the trainer's way: the same engine takes the new weights
        first.load_weights(b.named_parameters())
        second = first
    else:
        second = RolloutEngine(loader.from_hf_model(b), None, spec=spec_second, eos_token_ids=[], max_num_seqs=N)
    carried = [Carried(r.completion_ids, r.logprobs) for r in out]
    params.seed = 4
    done = second.generate([PROMPT], params, partial=PartialRound([carried], stop_after_groups=1))
    assert all(r.finish_reason == "length" and r.completion_ids[:2] == c.completion_ids
               for r, c in zip(done, carried))
    return (torch.tensor([r.completion_ids for r in done]), torch.tensor([r.logprobs for r in done]),
            second.stats())


def exact_law(a, b, params=None):
    """Every 4-token sequence and its probability: two tokens from a, then two from b (HF forwards, with HF's own
    temperature / top-k / top-p warpers when `params` asks for them; no truncation boundary near a tie)."""
    seqs, probs = torch.zeros(1, 0, dtype=torch.long), torch.ones(1, dtype=torch.float64)
    warpers = hf_warpers(params) if params is not None else None
    for model in (a, a, b, b):
        ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
            if warpers is None:
                p = torch.softmax(logits.double(), -1)
            else:
                _check_margins(logits, params, 1e-4)
                p = torch.softmax(warpers(ids, logits.clone()), -1).double()
        parent, tok = torch.arange(len(seqs)).repeat_interleave(V), torch.arange(V).repeat(len(seqs))
        keep = p[parent, tok] > 0
        seqs, probs = torch.cat([seqs[parent], tok[:, None]], 1)[keep], (probs[parent] * p[parent, tok])[keep]
    return seqs, probs


def token_logprobs(models, samples: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[N, 4] log p(x_t | prompt, x_<t) under models[t] (the policy that drew position t), at `temperature`
    before any truncation (what the engine records: docs/verification.md#logprobs)."""
    ids = torch.cat([torch.tensor(PROMPT).expand(len(samples), -1), samples], 1)
    out = []
    for t, model in enumerate(models):
        with torch.no_grad():
            logits = model(ids[:, :len(PROMPT) + t]).logits[:, -1].double() / temperature
        out.append(torch.log_softmax(logits, -1).gather(1, samples[:, t:t + 1])[:, 0])
    return torch.stack(out, 1)


def claimed_law_pvalue(samples: torch.Tensor, recorded: torch.Tensor, min_expected: float = 20.0) -> float:
    """Chi-square of the samples' frequencies against the law their records claim: each sequence with probability
    exp(sum of its recorded logprobs). Cells are the sequences that law expects at least min_expected times (under
    a true claim each is observed but with probability e^-20, so choosing them among the observed ones is no
    bias), plus one cell for everything else (its count and its claimed mass, what is left of N and of 1)."""
    seqs, inverse, counts = torch.unique(samples, dim=0, return_inverse=True, return_counts=True)
    claimed = torch.zeros(len(seqs), dtype=torch.float64)
    claimed[inverse] = recorded.double().sum(1).exp()
    big = claimed * len(samples) >= min_expected
    rest_count, rest_mass = len(samples) - counts[big].sum(), max(0.0, 1.0 - float(claimed[big].sum()))
    return chi2_pvalue(torch.cat([counts[big].double(), torch.tensor([float(rest_count)], dtype=torch.float64)]),
                       torch.cat([claimed[big], torch.tensor([rest_mass], dtype=torch.float64)]))


@pytest.mark.parametrize("second", ["plain", "suffix"])
def test_carried_samples_keep_the_law_of_the_policies_that_drew_them(second):
    spec = None if second == "plain" else SpecConfig(drafter="suffix", num_draft_tokens=2, selector="always")
    samples, recorded, stats = two_rounds(spec)
    a, b = policies()
    if spec is not None:  # the continuation did speculate: drafts were verified and some accepted
        assert stats["rollout/spec_step_share"] > 0 and stats["rollout/accept_rate"] > 0, stats
    seqs, probs = exact_law(a, b)
    assert sequence_pvalue(samples, seqs, probs) > ALPHA
    truth = token_logprobs((a, a, b, b), samples)
    assert torch.allclose(recorded.double(), truth, atol=1e-4), (recorded.double() - truth).abs().max()
    assert claimed_law_pvalue(samples, recorded) > ALPHA
    # the flaw the gate must catch: the prefix recorded with the newer policy's probabilities
    flawed = torch.cat([token_logprobs((b, b), samples[:, :2]), recorded[:, 2:].double()], 1)
    assert not torch.allclose(flawed, truth, atol=1e-4)
    assert claimed_law_pvalue(samples, flawed) < ALPHA


def test_carried_samples_keep_the_truncated_law_at_temperature_07_with_top_k_and_top_p():
    """T = 0.7, top-k 4, top-p 0.9: the samples fit the law of HF's warpers, two tokens from each policy; every
    recorded logprob is the drawing policy's at T = 0.7 before truncation; a prefix recorded with the newer
    policy's logprobs is caught."""
    sampling = dict(temperature=0.7, top_k=4, top_p=0.9)
    samples, recorded, _ = two_rounds(None, **sampling)
    a, b = policies()
    seqs, probs = exact_law(a, b, SamplingParams(**sampling))
    assert len(seqs) < V ** 4  # the truncation removed sequences: the test exercises it
    assert sequence_pvalue(samples, seqs, probs) > ALPHA
    assert sequence_pvalue(samples, *exact_law(b, b, SamplingParams(**sampling))) < ALPHA  # the newer policy's law
    truth = token_logprobs((a, a, b, b), samples, 0.7)
    assert torch.allclose(recorded.double(), truth, atol=1e-4), (recorded.double() - truth).abs().max()
    flawed = torch.cat([token_logprobs((b, b), samples[:, :2], 0.7), recorded[:, 2:].double()], 1)
    assert not torch.allclose(flawed, truth, atol=1e-4)


@pytest.mark.parametrize("spec", [None, SpecConfig(drafter="suffix", selector="always")], ids=["plain", "suffix"])
def test_a_greedy_carried_sample_continues_token_for_token(spec):
    """Greedy, float32: stopping a round anywhere and carrying on (after the same weights are pushed again)
    gives exactly the tokens of one uninterrupted call."""
    hf = make_tiny_hf("llama")
    engine = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], max_num_seqs=8)
    prompts, greedy = [[1, 5, 6, 7], [1, 8, 9]], SamplingParams(temperature=0, max_new_tokens=60)
    straight = engine.generate(prompts, greedy)
    carried = 0
    for stop in (1, 3, 5):
        part = engine.generate(prompts, greedy, partial=PartialRound([[None], [None]], 0, min_decode_steps=stop))
        going = [i for i, r in enumerate(part) if r.finish_reason == "partial"]
        assert going, "nothing was left to carry: stop earlier"
        engine.load_weights(hf.named_parameters())
        rest = engine.generate([prompts[i] for i in going], greedy, partial=PartialRound(
            [[Carried(part[i].completion_ids, part[i].logprobs)] for i in going], stop_after_groups=len(going)))
        for i, r in zip(going, rest):
            part[i] = r
        assert [r.completion_ids for r in part] == [r.completion_ids for r in straight]
        carried += len(going)
    assert carried >= 5


def test_a_round_stops_once_enough_groups_are_complete():
    """Groups complete at different steps: the round stops at the first step at which stop_after_groups are
    complete (and min_decode_steps ran), the others come back unfinished; a seeded round is reproducible."""
    hf = make_tiny_hf("llama")
    engine = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[], max_num_seqs=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0)
    carried = Carried([7] * 35, [-1.0] * 35)  # 5 tokens left: its group completes at decode step 5
    plan = PartialRound([[carried], [None, None]], stop_after_groups=1)
    out = engine.generate([[1, 5], [1, 6]], params, partial=plan)
    assert out[0].finish_reason == "length" and len(out[0].completion_ids) == 40
    assert out[0].logprobs[:35] == [-1.0] * 35  # the carried records come back as they went in
    assert [r.finish_reason for r in out[1:]] == ["partial", "partial"]
    assert [len(r.completion_ids) for r in out[1:]] == [6, 6]  # the prefill's token + 5 decode steps
    late = engine.generate([[1, 5], [1, 6]], params, partial=PartialRound(plan.samples, 1, min_decode_steps=9))
    assert [len(r.completion_ids) for r in late[1:]] == [10, 10]
    again = engine.generate([[1, 5], [1, 6]], params, partial=plan)
    assert [r.completion_ids for r in again] == [r.completion_ids for r in out]


def test_a_finished_sample_cannot_be_carried():
    hf = make_tiny_hf("llama")
    engine = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], max_num_seqs=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="holds a stop token"):
        engine.generate([[1, 5]], params, partial=PartialRound([[Carried([7, 2], [-1.0, -1.0])]], 1))
    with pytest.raises(ValueError, match="whole budget"):
        engine.generate([[1, 5]], params, partial=PartialRound([[Carried([7] * 4, [-1.0] * 4)]], 1))
    with pytest.raises(ValueError, match="at least one token"):
        Carried([], [])
