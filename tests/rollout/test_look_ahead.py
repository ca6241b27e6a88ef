"""Plain steps that launch their successor before the host reads them (rollout/decode.py, `Call.ahead`; on by
default where the device runs steps while the host works, CUDA; switched on here): the same tokens and finish
reasons as the step-by-step loop, greedy and with keyed draws, as rows end at different steps, by a stop token and
by length, and their logprobs to rounding (the step after a row's end still holds that row, and a product over a
batch of another size may round differently); off where the draws depend on the batch (a call's generator without
keys); and each step still one host transfer."""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.decode import DecodeSteps
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf("llama", seed=11)


def launches(monkeypatch, carried: list | None = None) -> list[int]:
    """The `ahead` of every plain step launched (1: before the host read the step in front of it); carried: the
    rows that had ended, for each step launched ahead with such rows riding along."""
    seen, real = [], DecodeSteps._launch_plain

    def spy(self, tokens, start, top, live, ctx, ahead):
        seen.append(ahead)
        if carried is not None and ahead and any(s.finished for s in live):
            carried.append(sum(s.finished for s in live))
        return real(self, tokens, start, top, live, ctx, ahead)

    monkeypatch.setattr(DecodeSteps, "_launch_plain", spy)
    return seen


def run(hf, look_ahead: bool, params: SamplingParams, prompts, keys=None, eos=(2,), **kw):
    engine = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=list(eos), **kw)
    engine.look_ahead = look_ahead
    out = engine.generate(prompts, params, sample_keys=keys)
    return [(r.completion_ids, r.logprobs, r.finish_reason) for r in out], engine


def stop_tokens(hf, prompts, params, keys=None) -> list[int]:
    """Tokens that end some rows early and not others: each row's third token of an unstopped run."""
    plain, _ = run(hf, False, params, prompts, keys, eos=())
    return sorted({ids[2] for ids, _, _ in plain[:3]})


@pytest.mark.parametrize("keyed", [False, True])
def test_look_ahead_gives_the_step_by_step_rollouts(hf, keyed, monkeypatch):
    """Rows ending at different steps (stop tokens) and by length (n samples of 12 or 20 tokens): greedy, or
    sampled with keyed draws, the looked-ahead rollouts equal the step-by-step ones in every token and finish
    reason, and most steps were launched ahead."""
    prompts = random_prompts(5, 4, 40, seed=2)
    params = SamplingParams(temperature=0.0 if not keyed else 1.0, max_new_tokens=20, n=2)
    keys = list(range(100, 110)) if keyed else None
    stops = stop_tokens(hf, prompts, params, keys)
    want, _ = run(hf, False, params, prompts, keys, eos=stops)
    seen = launches(monkeypatch)
    got, engine = run(hf, True, params, prompts, keys, eos=stops)
    assert [(ids, why) for ids, _, why in got] == [(ids, why) for ids, _, why in want]
    torch.testing.assert_close([lp for _, lp, _ in got], [lp for _, lp, _ in want], rtol=0, atol=1e-5)
    assert {r for _, _, r in got} == {"stop", "length"}  # rows ended both ways, at different steps
    assert sum(seen) > len(seen) // 2, seen  # the path under test ran: most steps launched ahead


def test_rows_that_ended_ride_along_in_the_tail(hf, monkeypatch):
    """Rows ending one by one (a stop token, keyed draws) with nothing left to admit: steps go on looking ahead
    with up to an eighth of the batch ended, those rows frozen where they ended (no token, no block), and the
    rollouts are the step-by-step loop's."""
    prompts = random_prompts(16, 4, 40, seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    keys = list(range(200, 216))
    stops = stop_tokens(hf, prompts, params, keys)
    want, _ = run(hf, False, params, prompts, keys, eos=stops)
    carried = []
    launches(monkeypatch, carried)
    got, engine = run(hf, True, params, prompts, keys, eos=stops)
    assert [(ids, why) for ids, _, why in got] == [(ids, why) for ids, _, why in want]
    assert carried and max(carried) <= 2 and {why for _, _, why in got} == {"stop", "length"}, carried
    assert engine.runner.cache.alloc.used == 0, "every block came back"
    share = engine.stats()["rollout/ahead_share"]  # steps launched ahead, with the carry and without
    engine.carry_ended = False
    engine.generate(prompts, params, sample_keys=keys)
    assert share > engine.stats()["rollout/ahead_share"] > 0


def test_no_look_ahead_where_draws_follow_the_batch(hf, monkeypatch):
    """Sampling from the call's generator without keys: a row's uniforms depend on which rows the step holds, so
    a step launched before a row ended would draw other tokens for the rest; such calls step one at a time."""
    seen = launches(monkeypatch)
    run(hf, True, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), random_prompts(3, 4, 40, seed=1))
    assert seen and set(seen) == {0}


def test_look_ahead_keeps_one_transfer_a_step_and_the_step_count(hf):
    """Each committed step is one host transfer and one step of the trace, as without the look-ahead; a call whose
    rows all run to their length launches no step past them."""
    prompts = random_prompts(4, 4, 40, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    _, plain = run(hf, False, params, prompts)
    _, ahead = run(hf, True, params, prompts)
    steps = [len(e.batch_trace) for e in (plain, ahead)]
    d2h = [e.runner.transfers.counts["d2h"] for e in (plain, ahead)]
    assert steps[0] == steps[1] and d2h[0] == d2h[1]


@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_look_ahead_under_forced_preemption_equals_transformers(drafter, monkeypatch):
    """A pool too small for the batch: a look-ahead takes a block only where the pool has one (it never preempts;
    the loop does, between runs of steps), so preempted, resumed and looked-ahead rows still give transformers'
    greedy continuations, and every block comes back; also with an EAGLE-3 drafter drafting every third step, whose
    staged features a preemption takes with the blocks and a resume stages again."""
    from rlspec.rollout.speculation.selectors.base import OFF, Arm
    from tests.rollout.test_paging import eagle, engine, hf_greedy

    hf = make_tiny_hf("llama", seed=2)
    prompts = random_prompts(6, 2, 25, seed=3)
    eng = engine(hf, blocks=40 if drafter is None else 44, spec=eagle(1) if drafter else None)
    eng.look_ahead, steps = True, []
    if drafter:
        eng.speculation.choose = lambda b: steps.append(b) or (Arm("eagle3", 3) if len(steps) % 3 == 0 else OFF)
    seen = launches(monkeypatch)
    got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, n=2))
    stats = eng.stats()
    assert stats["rollout/preemptions"] > 0 and sum(seen) > 0
    assert drafter is None or stats["rollout/spec_step_share"] > 0.1
    for i, r in enumerate(got):
        ref = hf_greedy(hf, prompts[i // 2], 24, eos=2)
        assert r.completion_ids == (ref[: ref.index(2) + 1] if 2 in ref else ref)
    assert eng.runner.cache.alloc.used == 0, "every block came back"


def test_look_ahead_between_speculative_steps_keeps_greedy_exactness(hf, monkeypatch):
    """The selector's choices scripted: three plain steps, then two 3-token n-gram chains, over and over. Each
    run of plain steps is looked ahead until the look-ahead meets a chain, whose arm it hands to the loop (chosen
    once, not twice); greedy rollouts stay transformers' own."""
    from rlspec.rollout.speculation.selectors.base import OFF, Arm
    from rlspec.rollout.speculation.speculation import Speculation
    from rlspec.rollout.types import SpecConfig
    from tests.rollout.test_engine_ar import hf_greedy

    script, chosen = [OFF, OFF, OFF, Arm("ngram", 3, 1), Arm("ngram", 3, 1)], []

    def choose(self, batch):
        chosen.append(script[len(chosen) % len(script)])
        return chosen[-1]

    monkeypatch.setattr(Speculation, "choose", choose)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9, 3], [4, 8, 15, 16]]
    spec = SpecConfig(drafter="ngram", num_draft_tokens=3, online_training=False)
    engine = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    engine.look_ahead = True
    seen = launches(monkeypatch)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    for p, r in zip(prompts, got):
        assert r.completion_ids == hf_greedy(hf, p, 24, eos=None)
    steps = len(engine.batch_trace)
    assert len(chosen) == steps  # one choice a step: a look-ahead's refused arm is the next step's
    assert sum(seen) > 0 and 0 < engine.stats()["rollout/spec_step_share"] < 1  # both kinds of step ran


def test_look_ahead_with_a_learned_drafter_stages_the_features_the_drafts_read(hf, monkeypatch):
    """With an EAGLE-3 drafter, plain steps look ahead too, staging each step's features as it is launched, at the
    positions it writes (a step past the host's commit). The drafter's catch-up reads those features, so a selector
    that drafts every third step gets the same drafts, and the same greedy rollouts, as the step-by-step loop:
    features staged one position off, or not at all, would change the drafts."""
    assert_learned_look_ahead(hf, "cpu", monkeypatch)


def assert_learned_look_ahead(hf, device: str, monkeypatch) -> None:
    """The test above on `device` (tests/gpu/test_cuda_look_ahead.py: CUDA, where a graph's outputs are the next
    replay's)."""
    from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
    from rlspec.rollout.speculation.selectors.base import OFF, Arm
    from rlspec.rollout.types import SpecConfig

    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, online_training=False)
    weights = None
    drafts, draft = [], Eagle3Drafter._draft

    def noted(self, *a):
        out = draft(self, *a)
        drafts.append(out[0].clone())
        return out

    monkeypatch.setattr(Eagle3Drafter, "_draft", noted)

    def rollout(look_ahead: bool):
        nonlocal weights
        engine = RolloutEngine(loader.from_hf_model(hf, torch.float32, device), None, spec=spec, eos_token_ids=[2])
        drafter = engine.speculation.learned
        if weights is None:
            with torch.no_grad():
                drafter.model.lm_head.weight.mul_(8.0)  # drafts that differ between rows and positions
            weights = drafter.model.state_dict()
        drafter.model.load_state_dict(weights)
        engine.look_ahead, steps = look_ahead, []
        engine.speculation.choose = lambda b: steps.append(b) or (Arm("eagle3", 3) if len(steps) % 3 == 0 else OFF)
        drafts.clear()
        out = engine.generate(random_prompts(3, 4, 40, seed=6), SamplingParams(temperature=0.0, max_new_tokens=24,
                                                                              n=2, ignore_eos=True))
        return [r.completion_ids for r in out], list(drafts)

    want, want_drafts = rollout(False)
    seen = launches(monkeypatch)
    got, got_drafts = rollout(True)
    assert got == want
    assert len(got_drafts) == len(want_drafts) >= 5
    assert all(torch.equal(a, b) for a, b in zip(got_drafts, want_drafts))
    assert sum(seen) >= len(seen) // 3, seen  # plain steps launched ahead of the host's read
