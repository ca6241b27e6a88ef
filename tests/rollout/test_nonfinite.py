"""Non-finite logits stop the rollout at the step they appear, naming the rows and the culprit.

Faults are real: a weight of the runtime model is set to NaN (before the call: the prefill catches it;
or after k decode steps, as a corrupting write mid-rollout would: the decode step catches it), or to a
huge finite value whose activations overflow (no parameter is bad; the hooked forward names the layer).
"""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.errors import NonFiniteLogitsError
from rlspec.rollout.nonfinite import finite_flags
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=0, ignore_eos=True)
# a repeated pattern, so the suffix drafter drafts long accepted runs from the first call on
PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 6]


def _engine(drafter: str | None = None, **lossy) -> RolloutEngine:
    """drafter None: plain decoding; lossy: SpecConfig fields of a lossy mode (rollout/lossy's verify path)."""
    spec = SpecConfig(drafter=drafter, selector="always", num_draft_tokens=4, online_training=False, **lossy) \
        if drafter else None
    return RolloutEngine(loader.from_hf_model(make_tiny_hf("llama", seed=5)), None, spec=spec, eos_token_ids=[2])


def _poison_after(eng: RolloutEngine, steps: int, param: torch.Tensor, drafted: bool = False) -> list[int]:
    """From the first decode step after `steps` (one verifying drafts, when `drafted`) on, param[0, 0] is NaN
    (the runner's forward sees it). Returns the tokens per row of each step forward, so len() is the step
    that raised."""
    run, shapes = eng.runner.step, []

    def step(tokens, *args, **kw):
        shapes.append(tokens.shape[1])
        if len(shapes) > steps and (tokens.shape[1] > 1 or not drafted) and torch.isfinite(param[0, 0]):
            with torch.no_grad():
                param[0, 0] = float("nan")
        return run(tokens, *args, **kw)

    eng.runner.step = step
    return shapes


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_nan_weight_is_caught_at_the_prefill(params):
    eng = _engine()
    with torch.no_grad():
        eng.model.model.layers[1].mlp.down_proj.weight[3, 7] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match=r"prefill.*model\.layers\.1\.mlp\.down_proj\.weight") as err:
        eng.generate(PROMPTS, params)
    assert err.value.step == 0 and err.value.first_bad == "parameter model.layers.1.mlp.down_proj.weight"
    assert err.value.rows == list(range(len(PROMPTS) * params.n))  # every row's logits are NaN


LOSSY_JUDGE = dict(verification="judge", judge="prob", judge_threshold=0.05, accept_off_policy=True)


@pytest.mark.parametrize("drafter,lossy", [(None, {}), ("suffix", {}), ("suffix", LOSSY_JUDGE)],
                         ids=["plain", "suffix", "suffix-lossy-judge"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_weight_going_nan_mid_rollout_stops_that_decode_step(drafter, lossy, params):
    eng = _engine(drafter, **lossy)
    assert (type(eng.verifier).__name__ == "LossyControl") == bool(lossy)
    if drafter:
        eng.generate(PROMPTS, params)  # the suffix index now holds these rollouts: the next call drafts
    gate_up = eng.model.model.layers[0].mlp.gate_up_proj.weight  # fused gate|up: row 0 is gate_proj's
    shapes = _poison_after(eng, 3, gate_up, drafted=drafter is not None)
    with pytest.raises(NonFiniteLogitsError) as err:
        eng.generate(PROMPTS, params)
    e, step = err.value, len(shapes)
    assert step > 3 and e.step == step, "the step whose forward first saw the NaN must raise"
    assert f"decode step {step}" in str(e) and "model.layers.0.mlp.gate_proj.weight" in e.first_bad
    assert e.rows == list(range(len(PROMPTS) * params.n))
    if drafter:
        assert shapes[-1] > 1, "the failing step verified drafts: the check must cover the verify path"


def test_an_activation_overflow_names_the_first_layer_whose_output_is_not_finite():
    """No parameter is NaN: a finite but huge weight overflows layer 0's output to inf; the hooked
    forward of the failing sequence names that layer."""
    eng = _engine()
    with torch.no_grad():
        eng.model.model.layers[0].mlp.gate_up_proj.weight.mul_(1e18)
        eng.model.model.layers[0].mlp.down_proj.weight.mul_(1e18)
    assert all(torch.isfinite(p).all() for p in eng.model.parameters())
    with pytest.raises(NonFiniteLogitsError) as err:
        eng.generate(random_prompts(3, seed=1), GREEDY)
    assert err.value.first_bad == "layer model.layers.0"


def test_the_engine_still_works_after_the_error():
    eng = _engine()
    weight = eng.model.model.layers[1].mlp.down_proj.weight
    saved, run = weight[0, 0].item(), eng.runner.step
    _poison_after(eng, 2, weight)
    with pytest.raises(NonFiniteLogitsError):
        eng.generate(PROMPTS, GREEDY)
    eng.runner.step = run
    with torch.no_grad():
        weight[0, 0] = saved  # the trainer pushes good weights again
    out = eng.generate(PROMPTS, GREEDY)
    assert all(len(r.completion_ids) == GREEDY.max_new_tokens for r in out)


def test_finite_flags_see_nan_and_both_infinities():
    logits = torch.zeros(5, 3, 8)
    logits[1, 2, 4] = float("nan")
    logits[2, 0, 0] = float("inf")
    logits[3, 1, 7] = float("-inf")
    assert finite_flags(logits).tolist() == [True, False, False, False, True]
    assert finite_flags(logits[:, 0]).tolist() == [True, True, False, True, True]


@pytest.mark.parametrize("drafter", [None, "suffix"], ids=["plain", "suffix"])
def test_after_a_transient_nan_the_next_call_equals_a_clean_engine(drafter):
    """A NaN weight mid-rollout, then the weight restored (on_nonfinite=skip_batch's situation): the next call
    samples exactly what an engine that never saw the NaN samples. The NaN keys and values the failed call
    wrote must not survive in the KV pool, where masked attention would read them as 0 x NaN."""
    eng, clean = _engine(drafter), _engine(drafter)
    weight = eng.model.model.layers[0].mlp.gate_up_proj.weight
    saved = weight.detach().clone()
    shapes = _poison_after(eng, 3, weight)
    with pytest.raises(NonFiniteLogitsError):
        eng.generate(PROMPTS, SAMPLED)
    eng.runner.step = type(eng.runner).step.__get__(eng.runner)  # the poisoning hook off
    with torch.no_grad():
        weight.copy_(saved)
    assert len(shapes) > 3
    if drafter:  # the failed call left no history: the clean engine sees the same first call
        eng.speculation.load_state_dict(clean.speculation.state_dict())
    got, want = eng.generate(PROMPTS, SAMPLED), clean.generate(PROMPTS, SAMPLED)
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
