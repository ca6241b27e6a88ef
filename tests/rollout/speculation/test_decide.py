"""The decision pipeline (rollout/speculation/decide.py): every step's arm comes with the stage that settled it,
counted as strategy/reason/<stage>, so "why did this step speculate (or not)?" has one answer per step."""
from __future__ import annotations

import pytest

from rlspec.rollout import metrics as M
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.cost_model import AcceptanceTracker
from rlspec.rollout.speculation.decide import REASONS, Decision
from rlspec.rollout.speculation.ledger import Ledger
from rlspec.rollout.speculation.selectors.adaptive import AdaptiveSelector
from rlspec.rollout.speculation.selectors.always import AlwaysSelector
from rlspec.rollout.speculation.selectors.arms import default_arms
from rlspec.rollout.speculation.selectors.base import OFF, Arm
from rlspec.rollout.speculation.selectors.fixed import FixedSelector
from rlspec.rollout.speculation.selectors.gate import LearnedGate, make_gates
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.speculation.test_selector import World, calibrated


def paying(drafters=("suffix",), **kw) -> AdaptiveSelector:
    """An adaptive selector whose drafter is known to pay at small batches (cheap verifies, acceptance 0.9)."""
    arms = default_arms(list(drafters), max_depth=4)
    sel = AdaptiveSelector(arms, ledger=Ledger(calibrated(World(), arms)), explore_cap=0.0, **kw)
    for name in drafters:
        sel.acceptance[name] = AcceptanceTracker(accepts=900.0, rejects=100.0)
    return sel


def decided(decision: Decision, sel, batch: int = 1) -> tuple[Arm, str]:
    arm = decision.decide(sel, batch)
    return arm, decision.reason


def test_the_selector_decides_when_no_stage_before_it_does():
    arm, reason = decided(Decision(), paying())
    assert arm.speculative and reason == "selector"


def test_no_drafter_means_off():
    assert decided(Decision(speculating=False), paying()) == (OFF, "off")


@pytest.mark.parametrize("how", ["force", "always"])
def test_a_forced_arm_plays_whatever_the_stages_after_it_say(how):
    arm = Arm("suffix", 2)
    d = Decision(max_spec_batch=0)
    sel = AlwaysSelector(arm) if how == "always" else paying()
    if how == "force":
        d.forced = arm
    assert decided(d, sel, batch=8) == (arm, "forced")


@pytest.mark.parametrize("how", ["selector", "force", "always"])
def test_unhealthy_drafters_decode_plainly_even_under_a_forced_arm(how):
    """A pool's worker whose pushed drafter failed its checks decodes plainly whatever its selector is."""
    arm = Arm("suffix", 2)
    d = Decision(healthy=False)
    sel = AlwaysSelector(arm) if how == "always" else paying()
    if how == "force":
        d.forced = arm
    assert decided(d, sel) == (OFF, "health")


def test_max_spec_batch_caps_the_live_batch_that_may_speculate():
    d = Decision(max_spec_batch=4)
    assert decided(d, paying(), batch=8) == (OFF, "max_spec_batch")
    arm, reason = decided(d, paying(), batch=4)
    assert arm.speculative and reason == "selector"


def test_the_loss_guard_holds_a_speculative_pick_below_its_floor():
    sel = paying()
    sel.ledger.saved, sel.ledger.plain_time = -1.0, 10.0  # speculation already lost 10% of plain time: > alpha
    assert decided(Decision(), sel) == (OFF, "guard") and sel.guard.held == 1
    sel.ledger.saved = 0.0  # above the floor, the same pick plays
    arm, reason = decided(Decision(), sel)
    assert arm.speculative and reason == "selector"


def test_a_closed_gate_is_named_when_it_leaves_nothing_to_speculate_with():
    sel = paying(drafters=("eagle3",), gates=make_gates(("eagle3",), trusted=False))  # no evidence: closed
    assert decided(Decision(), sel) == (OFF, "gate")
    fixed = FixedSelector("eagle3", 4, gate=LearnedGate(), ledger=Ledger(calibrated(World(), [Arm("eagle3", 4)])))
    assert decided(Decision(), fixed) == (OFF, "gate")
    sel.admit("eagle3", None)  # weights from a trained directory: trusted, the gate opens at the next check
    arm, reason = decided(Decision(), sel)
    assert arm.speculative and reason == "selector"


def test_the_reason_counts_are_metrics_that_restart_at_each_read():
    d, sel = Decision(max_spec_batch=4), paying()
    for batch in (1, 8, 8):
        d.decide(sel, batch)
    assert d.metrics() == {"strategy/reason/selector": 1.0, "strategy/reason/max_spec_batch": 2.0}
    assert d.metrics() == {}
    assert set(REASONS) == {"off", "forced", "health", "max_spec_batch", "guard", "gate", "selector"}


def test_the_engine_reports_a_reason_for_every_decode_step():
    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama")), None, eos_token_ids=[2],
                        spec=SpecConfig(drafter="suffix", num_draft_tokens=3), compile_mode="off")
    prompts = random_prompts(3, 3, 10, seed=2)
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    s = eng.stats()
    reasons = {k: v for k, v in s.items() if k.startswith("strategy/reason/")}
    assert reasons and sum(reasons.values()) == s[M.DECODE_STEPS]
    eng.speculation.force(Arm("suffix", 2))
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    s = eng.stats()
    assert s["strategy/reason/forced"] == s[M.DECODE_STEPS] > 0


@pytest.mark.parametrize("module,old,new", [("longtail", "LongTailSelector", FixedSelector),
                                            ("forced", "ForcedSelector", AlwaysSelector),
                                            ("bandit", "AdaptiveSelector", AdaptiveSelector)])
def test_old_selector_names_still_import_with_a_deprecation_warning(module, old, new):
    """One name per selector for file, class and config key ("fixed" / fixed.py / FixedSelector); the names a
    user could have imported before still work and say what to use."""
    import importlib

    mod = importlib.import_module(f"rlspec.rollout.speculation.selectors.{module}")
    with pytest.warns(DeprecationWarning, match=new.__name__):
        assert getattr(mod, old) is new
    with pytest.warns(DeprecationWarning):
        assert mod.Arm is Arm  # what else the old module held
